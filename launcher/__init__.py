"""Login-node launcher: recipe loading, plan, hetjob rendering and submission, status/logs/cancel.

Never imports torch: it must start in well under a second on a login node.
"""
