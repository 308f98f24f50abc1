"""A tiny random Qwen3 model with a byte-level BPE tokenizer, for running real vLLM without a model hub.

``generate_tiny_model(DIR, seed=N, spec=SIZES[name])`` writes ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and a ChatML chat template with ``save_pretrained``. The same
seed gives the same files byte for byte. The weights are random but drawn with a large initializer range
(0.3): with the usual 0.02 a small model's greedy output only echoes the last prompt token whatever its KV cache
holds, so a corrupted prefill -> decode transfer would go unnoticed; at 0.3 the output depends on the whole
context.

Sizes (:data:`SIZES`, ``pdctl model tiny --size``): ``tiny`` (the default, the verified CPU recipe's ~0.4M
parameters: quick to start, too small for a prefill to stall decode) and ``small`` / ``medium`` (13M / 40M
parameters), big enough that a long prompt's prefill takes of the order of a second on one CPU core while a
decode step of a few sequences stays at tens of ms: where colocated decode stalls (issue #18). Their
tokenizers also learn ``pdctl bench``'s word list, so a bench prompt of N words is N tokens on the engine too.

transformers, tokenizers and torch come with vLLM; they are imported only when a model is generated.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdctl.config.recipe import RECIPE_REQUESTS
from pdctl.errors import EngineMissingError, PdctlError
from pdctl.vllm.modelinfo import read_json_object
from pdctl.vllm.words import WORDS

__all__ = ["SIZES", "TINY_MODEL_FILES", "TinyModel", "TinyModelSpec", "generate_tiny_model", "model_digest"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Mixed English/Chinese text (including the recipe's test prompts) so the merges cover both scripts.
TRAINING_TEXT = (
    *(r.prompt for r in RECIPE_REQUESTS),
    "KV Cache 是大模型推理时缓存注意力键和值的技术，可以避免重复计算。",
    "预填充阶段计算提示词的缓存，解码阶段逐个生成新的词元。",
    "把预填充和解码分开部署，可以同时满足首字延迟和每字延迟的目标。",
    "Prefill and decode run on separate instances; the KV cache moves from one to the other.",
    "The quick brown fox jumps over the lazy dog while the model streams tokens to the client.",
    "A gateway holds one API key, routes each request through two legs, and streams the answer back.",
    "Hello, world! This is a tiny random model for testing disaggregated serving on a CPU.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ? ! ' \" # @ $ % ^ & _ ~ `",
)

# The files save_pretrained writes that define the model; their hashes make the determinism check.
TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the generated model (the defaults are the verified CPU recipe's)."""

    vocab_size: int = 400
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    # CPU attention rejects small head sizes (head_dim=16 fails at the first request); 64 works.
    head_dim: int = 64
    max_position_embeddings: int = 4096
    initializer_range: float = 0.3
    # Train the tokenizer on pdctl bench's words too (one token each), so bench prompt lengths hold.
    bench_words: bool = False


_LARGER = TinyModelSpec(vocab_size=2048, max_position_embeddings=8192, bench_words=True)

# ``pdctl model tiny --size NAME``; docs/cpu.md has what each one costs per prefill and per decode step.
SIZES: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "small": replace(_LARGER, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2),
    "medium": replace(_LARGER, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                      num_attention_heads=12, num_key_value_heads=4),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A generated model folder and what it holds."""

    path: Path
    seed: int
    vocab_size: int
    num_parameters: int
    files: tuple[str, ...]
    created: bool


def model_digest(path: str | Path) -> dict[str, str]:
    """SHA-256 of each file in a model folder, by file name (what "the same model" means)."""
    root = Path(path)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def generate_tiny_model(
    out_dir: str | Path, *, seed: int = 0, force: bool = False, spec: TinyModelSpec | None = None
) -> TinyModel:
    """Write a random Qwen3ForCausalLM + byte-level BPE tokenizer to ``out_dir``.

    An existing model folder generated with the same seed and spec is reused unless ``force``; a non-empty
    folder that is not one is refused, so a typo cannot overwrite someone's files.
    """
    spec = spec or TinyModelSpec()
    shape = asdict(spec)
    root = Path(out_dir).expanduser()
    marker = root / "pdctl-model.json"
    if root.exists() and not root.is_dir():
        raise PdctlError(f"{root}: exists and is not a folder", hint="choose another path for the model")
    if root.is_dir() and any(root.iterdir()):
        if not force:
            existing = read_json_object(marker)
            # Folders written before sizes existed hold the default spec.
            same_shape = existing is not None and existing.get("spec", asdict(TinyModelSpec())) == shape
            if existing is not None and existing.get("seed") == seed and same_shape and _complete(root):
                return TinyModel(
                    path=root,
                    seed=seed,
                    vocab_size=int(existing.get("vocab_size", 0)),
                    num_parameters=int(existing.get("num_parameters", 0)),
                    files=tuple(sorted(p.name for p in root.iterdir())),
                    created=False,
                )
            if existing is None:
                what = "other files"
            elif existing.get("seed") != seed:
                what = "a tiny model with another seed"
            else:
                what = "a tiny model of another size"
            raise PdctlError(
                f"{root}: folder is not empty (it holds {what})",
                hint="pass --force to replace it, or choose an empty folder",
            )
        if marker.exists() or _complete(root):
            shutil.rmtree(root)
        else:
            raise PdctlError(
                f"{root}: folder holds files that are not a pdctl tiny model; refusing to delete them",
                hint="choose an empty folder",
            )

    torch, transformers, tokenizers = _import_engine()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = _train_tokenizer(tokenizers, transformers, spec)
    vocab_size = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    num_parameters = int(sum(p.numel() for p in model.parameters()))

    tmp = root.with_name(root.name + ".tmp-pdctl")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "pdctl-model.json").write_text(
            json.dumps(
                {"generator": "pdctl model tiny", "seed": seed, "vocab_size": vocab_size,
                 "num_parameters": num_parameters, "spec": shape},
                indent=2,
            ) + "\n",
            encoding="utf-8",
        )  # fmt: skip
        if root.exists():
            root.rmdir()
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TinyModel(
        path=root,
        seed=seed,
        vocab_size=vocab_size,
        num_parameters=num_parameters,
        files=tuple(sorted(p.name for p in root.iterdir())),
        created=True,
    )


def _complete(root: Path) -> bool:
    return all((root / name).is_file() for name in TINY_MODEL_FILES)


def _import_engine() -> tuple[Any, Any, Any]:
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as exc:
        raise EngineMissingError(
            f"generating the tiny model needs torch, transformers and tokenizers ({exc.name or exc} is missing)",
            hint="install the CPU engine first: scripts/install-cpu-engine.sh "
            "(or `pip install 'pdctl[cpu]'`, see docs/cpu.md)",
        ) from None
    return torch, transformers, tokenizers


def _train_tokenizer(tokenizers: Any, transformers: Any, spec: TinyModelSpec) -> Any:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(TRAINING_TEXT)
    if spec.bench_words:
        corpus += [" " + " ".join(WORDS)] * 8
    # Repeating the corpus gives every merge a count above 1, so the vocabulary fills up to vocab_size.
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
