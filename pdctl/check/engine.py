"""Rules about the engines: what they load and what vLLM or the warm-up refuses at start.

- :func:`models` PD004/PD005: prefill and decode load different weights (PD005: a local path on one side, a
  hub name on the other); PD006: a local model folder that does not exist.
- :func:`lengths` PD024/PD026: ``max_model_len`` and ``max_num_batched_tokens`` against the model's context
  length (:func:`context_of`, from :mod:`pdctl.vllm.modelinfo`), as vLLM's start-up checks see them.
- :func:`identity` PD027: what the warm-up's identity rule (:func:`pdctl.vllm.identity.identity_problems`)
  would refuse, and a dtype NIXL's handshake refuses.
- :func:`sim` PD025: the simulator's profile, link and KV scale.
- :func:`vllm_refusals` PD028: the planned command lines through the installed vLLM's own parser
  (:mod:`pdctl.vllm.args`), on request only, after the other rules (it skips what they flagged).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from pdctl.check.findings import Action, Ctx, Finding, is_local
from pdctl.config import Deployment, WorkerConfig, keys_of
from pdctl.vllm.identity import WorkerIdentity, identity_problems
from pdctl.vllm.modelinfo import ContextLength, context_length
from pdctl.vllm.protocol import NIXL_CONNECTORS


def models(c: Ctx) -> Iterable[Finding]:
    """PD004/PD005: every worker loads the same model, named the same way; PD006: a local model exists."""
    dep = c.dep
    first = dep.prefill[0]
    for w in dep.workers[1:]:
        if w.model == first.model:
            continue
        local = [x for x in (first, w) if is_local(x.model)]
        if len(local) == 1:
            yield c.at("PD005", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} and {first.name} loads {first.model!r}: a local path on one "
                       "side and a hub name on the other gives garbage output (recipe §5.4) and fails NIXL's "
                       "compatibility hash", "pass the identical --model string to both",
                       fixes=({f"{w.table}.model": first.model},))  # fmt: skip
        else:
            yield c.at("PD004", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} but {first.name} loads {first.model!r} (recipe §5.4)",
                       "prefill and decode must load the same weights and tokenizer",
                       fixes=({f"{w.table}.model": first.model},))  # fmt: skip
    for w in dep.workers:
        folder = dep.resolve_path(w.model)
        if is_local(w.model) and w.engine == "vllm" and not Path(folder).exists():
            yield c.at("PD006", "error" if c.for_up else "warning", "config", f"{w.table}.model",
                       f"model folder {folder} does not exist",
                       "a random test model; or point model at the folder that holds the weights, e.g. from "
                       "`hf download MODEL --local-dir FOLDER`",
                       actions=(Action("run", f"pdctl model tiny {shlex.quote(str(folder))}"),))  # fmt: skip


def _agreed_len(c: Ctx) -> int | None:
    """The one ``max_model_len`` every worker can start with: the smallest limit any of them has."""
    limits: list[int] = []
    for w in c.dep.workers:
        limits += [n for n in (c.max_model_len(w), c.contexts[w.name].tokens) if n is not None]
        if w.enable_chunked_prefill is False and w.max_num_batched_tokens is not None:
            limits.append(w.max_num_batched_tokens)
    return min(limits) if limits else None


def _len_fixes(c: Ctx) -> tuple[Mapping[str, object], ...]:
    n = _agreed_len(c)
    return ({f"{w.table}.max_model_len": n for w in c.dep.workers},) if n is not None else ()


def _allows_long(c: Ctx, w: WorkerConfig) -> bool:
    value = w.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", c.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", ""))
    return value.lower() in ("1", "true")


def lengths(c: Ctx) -> Iterable[Finding]:
    """What vLLM's start-up checks of lengths refuse (``SchedulerConfig.verify_max_model_len``,
    ``_get_and_verify_max_len``), with the model's context length from :mod:`pdctl.vllm.modelinfo`."""
    for w in c.dep.workers:
        ctx = c.contexts[w.name]
        if w.max_model_len is not None and ctx.tokens is not None and w.max_model_len > ctx.tokens:
            if not _allows_long(c, w):
                yield c.at("PD026", "error", "config", f"{w.table}.max_model_len",
                           f"max_model_len {w.max_model_len} is more than {w.model}'s context length {ctx.tokens} "
                           f"(from {ctx.source}): vLLM refuses to start", fixes=_len_fixes(c))  # fmt: skip
        batched = w.max_num_batched_tokens
        if w.enable_chunked_prefill is not False or batched is None:
            continue
        max_len = c.max_model_len(w)
        fixes = (*_len_fixes(c), {f"{w.table}.enable_chunked_prefill": True})
        if max_len is not None and batched < max_len:
            source = "max_model_len" if w.max_model_len else f"{w.model}'s context length, from {ctx.source}"
            yield c.at("PD024", "error", "config", f"{w.table}.max_num_batched_tokens",
                       f"chunked prefill is off and max_num_batched_tokens ({batched}) is smaller than "
                       f"max_model_len ({max_len}; {source}): vLLM refuses to start", fixes=fixes)  # fmt: skip
        elif max_len is None:
            yield c.at("PD024", "warning", "config", f"{w.table}.max_num_batched_tokens",
                       f"chunked prefill is off, so vLLM refuses to start if the model's context length exceeds "
                       f"max_num_batched_tokens ({batched}); that length is {ctx.source}", fixes=fixes)  # fmt: skip


_DTYPES = {"half": "float16", "float": "float32"}


def identity(c: Ctx) -> Iterable[Finding]:
    """PD027: what the warm-up's identity rule (:func:`pdctl.vllm.identity.identity_problems`) would refuse."""
    workers = c.dep.workers
    if not workers:
        return

    def reported(w: WorkerConfig) -> WorkerIdentity:
        version = "the simulator" if w.engine == "sim" else f"vLLM {c.vllm.version}"
        return WorkerIdentity(w.model_name, None, c.max_model_len(w), version, None)

    ref = workers[0]
    for w in workers[1:]:
        if w.model != ref.model:
            continue  # PD004 / PD005 say it
        a, b = reported(ref), reported(w)
        if (a.max_model_len is None) != (b.max_model_len is None):
            unknown = ref if a.max_model_len is None else w
            yield c.at("PD027", "warning", "config", f"{unknown.table}.max_model_len",
                       f"{unknown.name}'s max_model_len comes from the model and its length is "
                       f"{c.contexts[unknown.name].source}: the warm-up refuses prefill and decode with different "
                       "max_model_len", fixes=_len_fixes(c))  # fmt: skip
        for problem in identity_problems(ref.name, a, w.name, b, require_tokenize=False):
            field = problem.split(":", 1)[0]
            message = f"the warm-up refuses workers that differ in what they report ({problem})"
            if field == "max_model_len" and a.max_model_len is not None and b.max_model_len is not None:
                yield c.at("PD027", "error", "config", f"{w.table}.max_model_len", message, fixes=_len_fixes(c))
            elif field == "id":
                yield c.at("PD027", "error", "config", f"{w.table}.served_model_name", message,
                           fixes=({f"{w.table}.served_model_name": ref.model_name},))  # fmt: skip
            elif field == "version":
                yield c.at("PD027", "error", "config", f"{w.table}.engine", message,
                           fixes=({f"{w.table}.engine": ref.engine},))  # fmt: skip
        da, db = _DTYPES.get(ref.dtype or "auto", ref.dtype), _DTYPES.get(w.dtype or "auto", w.dtype)
        if "auto" not in (da, db) and da != db and c.dep.connector_for(w) in NIXL_CONNECTORS:
            yield c.at("PD027", "error", "config", f"{w.table}.dtype",
                       f"dtype: {ref.name} {ref.dtype} != {w.name} {w.dtype}: NIXL's handshake compares a hash "
                       "that covers the dtype and fails with 'NIXL compatibility hash mismatch'",
                       fixes=({f"{w.table}.dtype": ref.dtype},))  # fmt: skip


def sim(c: Ctx) -> Iterable[Finding]:
    """PD025: the simulator's profile and link exist, and its KV scale keeps loopback cheap."""
    if not any(w.engine == "sim" for w in c.dep.workers):
        return
    from pdctl.sim.timing import LINKS, PROFILES

    dep = c.dep
    if dep.sim.profile not in PROFILES:
        yield c.at("PD025", "error", "config", "sim.profile", f"unknown simulator profile {dep.sim.profile!r}",
                   f"one of: {', '.join(sorted(PROFILES))}", fixes=({"sim.profile": "fast"},))  # fmt: skip
    if dep.kv_transfer.link not in LINKS:
        yield c.at("PD025", "error", "config", "kv_transfer.link", f"unknown link {dep.kv_transfer.link!r}",
                   f"one of: {', '.join(sorted(LINKS))}", fixes=({"kv_transfer.link": "loopback"},))  # fmt: skip
    elif dep.sim.profile in PROFILES and dep.sim.profile != "fast" and dep.sim.kv_scale > 0.01:
        per_token = PROFILES[dep.sim.profile].model.kv_bytes_per_token
        mib = per_token * 2048 * dep.sim.kv_scale / 2**20
        yield c.at("PD025", "warning", "config", "sim.kv_scale",
                   f"with profile {dep.sim.profile!r} each 2048-token prompt really moves {mib:.0f} MiB through "
                   "loopback, which costs this machine's CPU and distorts the timings",
                   "simulated transfer times still use the full size", fixes=({"sim.kv_scale": 0.001},))  # fmt: skip


def context_of(dep: Deployment, w: WorkerConfig, env: Mapping[str, str]) -> ContextLength:
    """``w``'s model's context length and where it comes from (the simulator's default for ``engine = "sim"``)."""
    local = is_local(w.model)
    model = dep.resolve_path(w.model) if local else w.model
    if w.engine == "sim":
        from pdctl.sim.__main__ import default_max_model_len

        return ContextLength(default_max_model_len(model, dep.sim.profile), "the simulator's default for it")
    return context_length(model, local=local, env=env)


def vllm_refusals(c: Ctx, found: list[Finding]) -> Iterable[Finding]:
    """PD028: the planned command lines run through vLLM's own parser and config classes (:mod:`pdctl.vllm.args`)."""
    from pdctl.runtime.plan import build_plan
    from pdctl.vllm.args import Command, ValidatorUnavailable, validate_commands

    workers = {w.name: w for w in c.dep.workers if w.engine == "vllm"}
    if not workers or c.vllm.distribution is None:
        return
    plan = build_plan(c.dep, c.vllm)
    launch = len(plan.vllm.launch)
    commands = [Command(p.name, p.argv[launch:], c.contexts[p.name].tokens) for p in plan.workers if p.name in workers]
    try:
        refusals = validate_commands(commands, python=c.vllm.python)
    except ValidatorUnavailable as exc:
        yield c.at("PD028", "info", "config", None, f"the command lines were not run through vLLM's parser: {exc}")
        return
    flagged = {f.key for f in found if f.severity == "error"}
    for r in refusals:
        w = workers[r.worker]
        key = _key_of_flag(w, r.flag)
        if key in flagged:
            continue  # a pdctl rule already said it, with a fix
        yield c.at("PD028", "error", "config", key,
                   f"vLLM {c.vllm.version} refuses {w.name}'s command line ({r.flag or 'no flag named'}): {r.message}",
                   "vLLM's default instead; `pdctl plan` shows the exact command line",
                   fixes=_without_flag(w, r.flag, key))  # fmt: skip


def _without_flag(w: WorkerConfig, flag: str | None, key: str) -> tuple[Mapping[str, object], ...]:
    """PD028's way out: drop the refused flag (and its value) from ``extra_args``, or the key behind it."""
    if flag is None:
        return ()
    if key == f"{w.table}.extra_args":
        args = list(w.extra_args)
        i = next(i for i, a in enumerate(args) if a == flag or a.startswith(flag + "="))
        takes_value = args[i] == flag and i + 1 < len(args) and not args[i + 1].startswith("-")
        del args[i : i + 1 + takes_value]
        return ({key: args or None},)
    if key.startswith(w.table + ".") and key.rpartition(".")[2] in keys_of(WorkerConfig):
        return ({key: None},)
    return ()


def _key_of_flag(w: WorkerConfig, flag: str | None) -> str:
    """The config key that puts ``flag`` on ``w``'s command line (its table when none does)."""
    if flag is None:
        return w.table
    if flag == "--kv-transfer-config":
        return "connector"
    if any(a == flag or a.startswith(flag + "=") for a in w.extra_args):
        return f"{w.table}.extra_args"
    for key, spec in keys_of(WorkerConfig).items():
        if spec.in_file and spec.flag and flag in (spec.flag, "--no-" + spec.flag.removeprefix("--")):
            return f"{w.table}.{key}"
    return w.table
