"""Progress numbers of the capture loop: rates over the last minute, ETA, the progress line."""

from __future__ import annotations

from runtime.capture.progress import CaptureProgress, format_bytes, format_duration


def test_rates_cover_the_last_minute_only() -> None:
    progress = CaptureProgress(total_samples=1000, started=0.0)
    progress.record([0, 1], tokens=200, num_bytes=10, now=5.0)
    assert progress.rates(now=10.0) == (0.2, 20.0)  # 2 samples in the 10 s since the start
    progress.record([2, 3, 4], tokens=300, num_bytes=10, now=100.0)
    samples_per_s, tokens_per_s = progress.rates(now=110.0)
    assert (samples_per_s, tokens_per_s) == (3 / 60, 300 / 60)  # the first two fell out of the window
    assert progress.frontier == 5 and progress.samples == 5 and progress.tokens == 500


def test_eta_uses_the_average_since_the_start() -> None:
    progress = CaptureProgress(total_samples=100, started=0.0)
    assert progress.eta_s(now=1.0) is None
    progress.record(list(range(10)), tokens=100, num_bytes=1, now=20.0)
    assert progress.eta_s(now=20.0) == 90 * 2.0  # 10 samples in 20 s: 2 s per sample, 90 to go
    assert progress.eta_s(now=40.0) == 90 * 4.0  # paused by the trainer: the average slows down
    progress.record(list(range(10, 100)), tokens=1, num_bytes=1, now=50.0)
    assert progress.eta_s(now=50.0) == 0.0


def test_line_names_rates_window_state_and_eta() -> None:
    progress = CaptureProgress(total_samples=64, started=0.0)
    progress.record([0, 1, 2, 3], tokens=1000, num_bytes=4096, now=1.0)
    window = {"cursor": 0, "window_end": 32, "resident_samples": 4, "resident_bytes": 4096, "in_flight": 2}
    line = progress.line(window, "paused: 32 samples resident")
    for part in (
        "4 samples / 1000 tokens",
        "samples/s",
        "tokens/s",
        "window [0, 32) 4 resident (4.0 KiB)",
        "2 in flight",
        "paused: 32 samples resident",
        "g=4 of 64",
        "ETA",
    ):
        assert part in line, (part, line)


def test_formats() -> None:
    assert format_duration(3725) == "1h02m05s" and format_duration(65) == "1m05s" and format_duration(None) == "?"
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.0 GiB"
