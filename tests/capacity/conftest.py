"""A profile computed from the simulator's h100 timing model (what `pdctl profile` would measure on it)."""

from __future__ import annotations

import pytest

from pdctl.capacity.profile import DecodePoint, DeploymentProfile, KVPoint, PrefillPoint, fit_decode, fit_line
from pdctl.sim.timing import get_link, get_profile


def timing_profile(name: str = "h100", link: str = "rdma-400g", max_num_seqs: int = 64) -> DeploymentProfile:
    sp, ln = get_profile(name), get_link(link)
    lens = (128, 512, 1024, 2048, 4096, 8192)
    kv = [KVPoint(n, ln.transfer_s(n * sp.model.kv_bytes_per_token)) for n in lens]
    pf = [PrefillPoint(n, sp.prefill_s(n), sp.prefill_s(n) + k.transfer_s) for n, k in zip(lens, kv, strict=True)]
    dc = [DecodePoint(n, c, sp.decode_step_s(n, c)) for c in (256, 2048) for n in (1, 4, 16, 64)]
    a, b = fit_line([p.prompt_tokens for p in pf], [p.prefill_s for p in pf])
    c, d = fit_line([p.tokens for p in kv], [p.transfer_s for p in kv])
    e, f, g = fit_decode(dc)
    return DeploymentProfile(
        source=f"sim:{name}", model=sp.model.name, measured_at="2026-12-05T00:00:00+00:00", prefill=pf, decode=dc,
        kv=kv, prefill_fixed_s=a, prefill_s_per_token=b, kv_fixed_s=c, kv_s_per_token=d,
        decode_fixed_s=e, decode_per_seq_s=f, decode_per_kv_token_s=g, decode_max_num_seqs=max_num_seqs,
    )  # fmt: skip


@pytest.fixture
def h100() -> DeploymentProfile:
    return timing_profile()
