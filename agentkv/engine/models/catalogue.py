"""Built-in model shapes: the dense Llama/Qwen3 shapes agentkv started with, and one public config per
family read from `agentkv/data/models/*.json` (fields copied from each model's Hugging Face config.json;
`_source` in each file says where from)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from importlib import resources
from pathlib import Path

from agentkv.engine.models.dtypes import lookup_key
from agentkv.engine.models.shape import ModelShape
from agentkv.errors import UserError

DENSE: tuple[ModelShape, ...] = (
    ModelShape(
        "Llama-3.1-8B",
        32,
        4096,
        32,
        8,
        128,
        14336,
        128256,
        False,
        ("llama3-8b", "llama-3-8b", "llama3.1-8b", "meta-llama-3.1-8b"),
    ),
    ModelShape(
        "Llama-3.1-70B",
        80,
        8192,
        64,
        8,
        128,
        28672,
        128256,
        False,
        ("llama3-70b", "llama-3-70b", "llama3.1-70b", "meta-llama-3.1-70b"),
    ),
    ModelShape(
        "Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, ("qwen3-32b",), 40960, family="qwen3"
    ),
)

# (fixture file, built-in name, aliases); the file's `_source` names the config it was copied from
FIXTURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("deepseek_v4_pro.json", "DeepSeek-V4-Pro", ("deepseek-v4-pro", "dsv4-pro")),
    ("deepseek_v4_flash.json", "DeepSeek-V4-Flash", ("deepseek-v4-flash", "dsv4-flash")),
    ("deepseek_v3.json", "DeepSeek-V3", ("deepseek-v3", "deepseek-ai/DeepSeek-V3", "DeepSeek-R1")),
    ("kimi_k2.json", "Kimi-K2", ("kimi-k2", "moonshotai/Kimi-K2-Instruct")),
    ("gpt_oss.json", "gpt-oss-120b", ("openai/gpt-oss-120b",)),
    ("qwen3_moe.json", "Qwen3-235B-A22B", ("qwen3-235b",)),
    ("qwen3_coder.json", "Qwen3-Coder-480B", ("qwen3-coder-480b-a35b", "qwen3-coder")),
    ("deepseek_v32.json", "DeepSeek-V3.2-Exp", ("deepseek-v3.2", "deepseek-v32")),
    ("deepseek_v2.json", "DeepSeek-V2-Lite", ("deepseek-v2-lite",)),
    ("qwen3_next.json", "Qwen3-Next-80B-A3B", ("qwen3-next", "qwen3-next-80b")),
    ("llama4.json", "Llama-4-Scout", ("llama-4-scout-17b-16e", "llama4-scout")),
    ("gemma3.json", "Gemma-3-27B", ("gemma-3-27b-it", "gemma3-27b")),
    ("qwen2.json", "Qwen2.5-7B", ("qwen2.5-7b",)),
)
BUILTIN_NAMES: tuple[str, ...] = tuple(m.name for m in DENSE) + tuple(name for _, name, _ in FIXTURES)
# files read only by tests: the same public configs as the dense built-ins
CHECK_FIXTURES = ("llama.json", "qwen3.json")


def fixture_config(file: str) -> dict:
    """One bundled config (`agentkv/data/models/FILE`), parsed."""
    return json.loads(resources.files("agentkv").joinpath("data/models", file).read_text())


def load_fixture(file: str, name: str | None = None, aliases: tuple[str, ...] = ()) -> ModelShape:
    """The shape of one bundled config, named `name` (default: the file's `_name_or_path`)."""
    from agentkv.engine.models.hf import shape_from_config

    cfg = fixture_config(file)
    shape = shape_from_config(cfg, f"agentkv/data/models/{file}", name or str(cfg.get("_name_or_path", file)))
    return replace(shape, aliases=aliases, source=str(cfg.get("_source", "")))


@cache
def builtin_models() -> tuple[ModelShape, ...]:
    """Every built-in shape, in catalogue order (fixtures are read on first use)."""
    return DENSE + tuple(load_fixture(file, name, aliases) for file, name, aliases in FIXTURES)


@cache
def _index() -> dict[str, ModelShape]:
    return {lookup_key(a): m for m in builtin_models() for a in (m.name, *m.aliases)}


def model_help(default: str = "llama3-8b") -> str:
    """The `--model` flag's help: every built-in name, then the config.json form."""
    return (
        f"model shape: {', '.join(BUILTIN_NAMES)} (any case; aliases such as llama3-8b), "
        f"or a Hugging Face config.json or its folder (default {default})"
    )


def model_names() -> list[str]:
    """Built-in model shape names."""
    return list(BUILTIN_NAMES)


def get_model(name: str | Path | ModelShape) -> ModelShape:
    """A built-in shape by name/alias (case-insensitive), or a path to a HF config.json or its folder."""
    if isinstance(name, ModelShape):
        return name
    m = _index().get(lookup_key(str(name)))
    if m is not None:
        return m
    if Path(name).exists():
        return ModelShape.from_hf_config(name)
    raise UserError(
        f"unknown model '{name}'; choose one of: {', '.join(model_names())}, "
        "or give the path of a Hugging Face config.json"
    )
