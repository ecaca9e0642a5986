"""Choosing the MoE exchange: the recipe's ``capture.moe_exchange``, overridden on the capture
command line by ``--k3-moe-exchange``, and building it."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from runtime.moe.exchange import MoEExchange

EXCHANGE_NAMES = ("nccl", "deepep", "mooncake")
"""Backends, default first (the values of ``capture.moe_exchange``)."""
CLI_FLAG = "--k3-moe-exchange"
DEFAULT_MAX_TOKENS_PER_DISPATCH = 128
"""Tokens per rank per low-latency dispatch call (the kernels' usual decode-sized setting)."""


def add_moe_exchange_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--k3-moe-exchange nccl|deepep|mooncake`` to the capture entry point's parser."""
    parser.add_argument(
        CLI_FLAG,
        dest="k3_moe_exchange",
        choices=EXCHANGE_NAMES,
        default=None,
        help="MoE dispatch/combine backend for expert-parallel capture; overrides the recipe's "
        "capture.moe_exchange (nccl: all-to-all, the default; deepep / mooncake: low-latency kernels, "
        "need a build compiled for the model's hidden size and top-k)",
    )


def chosen_exchange(args: argparse.Namespace, recipe_value: str) -> str:
    """The backend to use: the command-line flag when given, else the recipe's value."""
    name = getattr(args, "k3_moe_exchange", None) or recipe_value
    if name not in EXCHANGE_NAMES:
        raise ValueError(f"capture.moe_exchange is {name!r}; use one of {', '.join(EXCHANGE_NAMES)}")
    return name


def make_exchange(
    name: str,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    hidden_size: int,
    top_k: int,
    max_tokens_per_dispatch: int = DEFAULT_MAX_TOKENS_PER_DISPATCH,
) -> MoEExchange:
    """Build backend ``name`` over ``group``. The low-latency backends import their package and
    validate the shapes here, at start-up, so a bad pairing fails before the first sample."""
    if name == "nccl":
        from runtime.moe.exchange_nccl import AllToAllExchange

        return AllToAllExchange(group, num_experts)
    if name == "deepep":
        from runtime.moe.exchange_deepep import DeepEPExchange

        return DeepEPExchange(group, num_experts, hidden_size, top_k, max_tokens_per_dispatch)
    if name == "mooncake":
        from runtime.moe.exchange_mooncake import MooncakeEPExchange

        return MooncakeEPExchange(group, num_experts, hidden_size, top_k, max_tokens_per_dispatch)
    raise ValueError(f"unknown MoE exchange {name!r}; use one of {', '.join(EXCHANGE_NAMES)}")
