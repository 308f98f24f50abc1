"""The simulator's GPU timing model: model shapes, hardware profiles, links, and the formulas.

All times are *simulated* seconds; the engine divides them by ``--sim-speed`` before sleeping.

* prefill chunk of ``c`` new tokens after ``p`` already computed ones:
  ``flops = 2·N_nonemb·c + 4·c·(p + c/2)·(n_heads·head_dim)·L + 2·N_lmhead``
* decode token at context ``ctx``: ``flops = 2·N_nonemb + 4·ctx·(n_heads·head_dim)·L + 2·N_lmhead``
* one engine step (a batch of prefill chunks and decode tokens, ``n`` sequences in all):
  ``t = max(Σflops / (peak·mfu), (W_bytes + Σ KV bytes read) / (hbm_bw·bw_eff)) + step_overhead + n·seq_overhead``
* KV transfer of a prompt: ``t = kv_bytes / link_bw + link_latency`` with
  ``kv_bytes = 2·L·kv_heads·head_dim·dtype_bytes·tokens`` (the full model size, not the scaled test bytes).

See docs/simulator.md for the derivation, the calibration of the GPU profiles against bench-anchors.md §5 and of
the ``cpu-*`` profiles against real vLLM CPU runs (``benchmarks/calibrate_sim.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdctl.vllm.tiny_model import SIZES, TinyModelSpec

__all__ = [
    "CPU_CORE",
    "CPU_MODELS",
    "LINKS",
    "MODELS",
    "PROFILES",
    "Hardware",
    "Link",
    "ModelShape",
    "Profile",
    "get_link",
    "get_profile",
    "tiny_model_shape",
]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a transformer's config that decide FLOPs and bytes."""

    name: str
    layers: int
    hidden: int
    n_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    @property
    def params_nonemb(self) -> int:
        """Parameters of the transformer blocks (attention + gated MLP), without embeddings."""
        attn = self.hidden * (self.n_heads * self.head_dim) * 2 + self.hidden * (self.kv_heads * self.head_dim) * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def params_lmhead(self) -> int:
        """Parameters of the output projection."""
        return self.vocab * self.hidden

    @property
    def params_total(self) -> int:
        """All parameters (embedding counted twice unless tied)."""
        emb = self.vocab * self.hidden
        return self.params_nonemb + emb + (0 if self.tied_embeddings else self.params_lmhead)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by every forward step."""
        return self.params_total * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) × layers × KV heads × head_dim × dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_width(self) -> int:
        """n_heads × head_dim: the width of the attention score/value products."""
        return self.n_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class Hardware:
    """Peak numbers of one accelerator and the achieved fractions the model assumes."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # bytes/s
    mfu: float  # achieved fraction of peak_flops
    bw_eff: float  # achieved fraction of hbm_bw
    step_overhead_s: float  # scheduler + launch cost per engine step
    memory_bytes: float  # device memory, sizes the KV cache
    # Cost per sequence in a step (input preparation, sampling, output processing): negligible next to a GPU's
    # step, but on a CPU core vLLM's per-request Python work is what makes a decode step grow with the batch.
    seq_overhead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Link:
    """A KV transfer link: goodput in bytes/s and a fixed cost per transfer."""

    name: str
    bandwidth: float
    latency_s: float

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over this link."""
        return nbytes / self.bandwidth + self.latency_s


QWEN3_8B = ModelShape(
    name="Qwen3-8B",
    layers=36,
    hidden=4096,
    n_heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151936,
)


def tiny_model_shape(size: str, spec: TinyModelSpec) -> ModelShape:
    """The shape of the model ``pdctl model tiny --size SIZE`` generates from ``spec``.

    ``vocab`` is the tokenizer trainer's ceiling (``spec.vocab_size``); the trained vocabulary can come out
    smaller (1178 tokens for ``small`` and ``medium``), which changes the lm_head by well under 10 % of the
    parameters.
    """
    return ModelShape(
        name=f"tiny-qwen3-{size}",
        layers=spec.num_hidden_layers,
        hidden=spec.hidden_size,
        n_heads=spec.num_attention_heads,
        kv_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate=spec.intermediate_size,
        vocab=spec.vocab_size,
    )


# The random Qwen3 models `pdctl model tiny --size tiny|small|medium` writes (pdctl/vllm/tiny_model.py).
CPU_MODELS: dict[str, ModelShape] = {size: tiny_model_shape(size, spec) for size, spec in SIZES.items()}
TINY = CPU_MODELS["tiny"]
MODELS: dict[str, ModelShape] = {"qwen3-8b": QWEN3_8B, **CPU_MODELS}

_GB = 1e9
H100 = Hardware("H100-SXM", 989.4e12, 3.35e12, 0.5, 0.9, 0.0005, 80 * _GB)
H200 = Hardware("H200-SXM", 989.4e12, 4.8e12, 0.5, 0.9, 0.0005, 141 * _GB)
A100 = Hardware("A100-SXM-80GB", 312e12, 2.039e12, 0.5, 0.9, 0.0005, 80 * _GB)
# Near-zero compute so tests run in milliseconds; the overhead keeps streams observable.
FAST = Hardware("fast", 1e18, 1e18, 1.0, 1.0, 0.0002, 16 * _GB)
# One core of the 2-vCPU AMD EPYC machine running vLLM 0.32.0 CPU (bf16), one engine pinned to each core. The
# achieved numbers are fitted (mfu = bw_eff = 1: peak_flops and hbm_bw *are* the achieved rates), from
# docs/data/ab3-real-2026-12-04/ab.json.gz (2026-12-04, the `small` model, scripts/ab-demo.sh) with
#   .venv/bin/python -m benchmarks.calibrate_sim docs/data/ab3-real-2026-12-04/ab.json.gz
# The `tiny` and `medium` profiles reuse the core's numbers: extrapolated, not fitted. Memory: the 1 GiB of
# VLLM_CPU_KVCACHE_SPACE that examples/cpu-ab gives each engine.
CPU_CORE = Hardware(
    "cpu-core", peak_flops=57.5e9, hbm_bw=43.4e9, mfu=1.0, bw_eff=1.0, step_overhead_s=0.0131,
    memory_bytes=2**30, seq_overhead_s=0.00106,
)  # fmt: skip

LINKS: dict[str, Link] = {
    "loopback": Link("loopback", 20e9, 20e-6),
    "nvlink": Link("nvlink", 450e9, 10e-6),
    "pcie5": Link("pcie5", 64e9, 10e-6),
    "rdma-400g": Link("rdma-400g", 50e9, 30e-6),
    "rdma-200g": Link("rdma-200g", 25e9, 30e-6),
    "rdma-100g": Link("rdma-100g", 12.5e9, 30e-6),
    "tcp-10g": Link("tcp-10g", 1.17e9, 200e-6),
    "tcp-1g": Link("tcp-1g", 117e6, 200e-6),
}


@dataclass(frozen=True, slots=True)
class Profile:
    """A model on a device: everything the engine needs to time a step."""

    name: str
    model: ModelShape
    hw: Hardware

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in 90 % of memory after the weights (at least 65536)."""
        free = self.hw.memory_bytes * 0.9 - self.model.weight_bytes
        return max(65536, int(free // self.model.kv_bytes_per_token))

    def prefill_flops(self, new_tokens: int, past_tokens: int) -> float:
        """FLOPs of one prefill chunk (linear layers, causal attention, one lm_head row)."""
        m = self.model
        linear = 2.0 * m.params_nonemb * new_tokens
        attn = 4.0 * new_tokens * (past_tokens + new_tokens / 2.0) * m.attn_width * m.layers
        return linear + attn + 2.0 * m.params_lmhead

    def decode_flops(self, ctx: int) -> float:
        """FLOPs of one decode token at context length ``ctx``."""
        m = self.model
        return 2.0 * m.params_nonemb + 4.0 * ctx * m.attn_width * m.layers + 2.0 * m.params_lmhead

    def step_s(self, prefill: Iterable[tuple[int, int]], decode_ctx: Sequence[int]) -> float:
        """Seconds of one engine step: ``prefill`` = (new, past) per chunk, ``decode_ctx`` = context per token."""
        m, hw = self.model, self.hw
        flops = 0.0
        kv_read = 0
        seqs = len(decode_ctx)
        for new, past in prefill:
            seqs += 1
            flops += self.prefill_flops(new, past)
            kv_read += (past + new) * m.kv_bytes_per_token
        for ctx in decode_ctx:
            flops += self.decode_flops(ctx)
            kv_read += ctx * m.kv_bytes_per_token
        compute = flops / (hw.peak_flops * hw.mfu)
        memory = (m.weight_bytes + kv_read) / (hw.hbm_bw * hw.bw_eff)
        return max(compute, memory) + hw.step_overhead_s + hw.seq_overhead_s * seqs

    def prefill_s(self, tokens: int) -> float:
        """One whole-prompt prefill step on an otherwise idle engine."""
        return self.step_s([(tokens, 0)], [])

    def decode_step_s(self, batch: int, ctx: int) -> float:
        """One decode step of ``batch`` sequences at context ``ctx`` each."""
        return self.step_s([], [ctx] * batch)


PROFILES: dict[str, Profile] = {
    "fast": Profile("fast", TINY, FAST),
    "h100": Profile("h100", QWEN3_8B, H100),
    "h200": Profile("h200", QWEN3_8B, H200),
    "a100": Profile("a100", QWEN3_8B, A100),
    **{f"cpu-{size}": Profile(f"cpu-{size}", shape, CPU_CORE) for size, shape in CPU_MODELS.items()},
}


def get_profile(name: str) -> Profile:
    """The profile called ``name`` (ValueError listing the choices otherwise)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown --sim-profile {name!r}; choose one of {', '.join(PROFILES)}") from None


def get_link(name: str) -> Link:
    """The link called ``name`` (ValueError listing the choices otherwise)."""
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown --sim-link {name!r}; choose one of {', '.join(LINKS)}") from None
