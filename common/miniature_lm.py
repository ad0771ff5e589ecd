"""Training the miniature targets as small language models on the shipped demo corpus.

An acceptance length measured on a target means something only if the target writes text: a
randomly initialised miniature decodes greedily into a loop (one token repeated), which any
draft predicts perfectly. So the fixture code trains each miniature - its architecture and
shapes unchanged - as a next-token LM on every `data/demo_*.jsonl` conversation rendered
through the target's own chat template, the way a draft's training data is rendered.

Deterministic: fixed seeds, a fixed batch order, and one CPU thread while training (results of
multi-threaded float reductions depend on the thread count). Cheap enough for CI: a few hundred
optimizer steps, about 4 minutes (flat) and 12 minutes (Kimi-style) on one thread, once per cache.

Kimi-K2.5's vocabulary has 163,840 ids, of which the miniature's tokenizer produces ~4,100 (its
BPE ranks and the special tokens). A full softmax over all of them would make training ~40x
slower, so the loss scores the ids the tokenizer can produce one by one and the rest as one
shared lm_head row counted as many times as there are such ids (the logsumexp of N equal
logits is that logit + log N): exactly the full softmax with those rows tied, which is what
the exported lm_head holds.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["LMSettings", "corpus_files", "render_corpus", "train_miniature_lm", "greedy_continuations"]


@dataclass(frozen=True)
class LMSettings:
    """How a miniature is trained (part of the fixture cache key through the source hash)."""

    seq_len: int = 256  # tokens per training row (the corpus is one stream cut into rows)
    batch_size: int = 8
    steps: int = 600
    lr: float = 1e-2
    warmup: int = 20
    weight_decay: float = 0.01
    seed: int = 0
    # Matrices reading more than this many inputs learn at lr * lr_fan_in / fan_in (None: all at lr).
    lr_fan_in: int | None = None


def corpus_files(data_dir: Path) -> list[Path]:
    """Every shipped demo file, in name order (`data/demo_*.jsonl`)."""
    return sorted(data_dir.glob("demo_*.jsonl"))


def _conversations(files: list[Path]) -> Iterator[dict]:
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)


def render_corpus(tokenizer, files: list[Path]) -> tuple[list[list[int]], int]:
    """Each conversation as the token ids its chat template renders (tools passed when it has
    them); also how many conversations the template rejected (skipped)."""
    sequences, rejected = [], 0
    for record in _conversations(files):
        kwargs = {"tools": record["tools"]} if record.get("tools") else {}
        try:
            ids = tokenizer.apply_chat_template(record["messages"], tokenize=True, **kwargs)
        except Exception:  # noqa: BLE001 - any template error means: not this conversation
            rejected += 1
            continue
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        if len(ids) > 1:
            sequences.append(list(ids))
    return sequences, rejected


@contextmanager
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _batches(sequences: list[list[int]], settings: LMSettings) -> Iterator[torch.Tensor]:
    """Rows of `seq_len` tokens cut from the corpus stream, the conversations shuffled anew each
    pass (a fixed generator), `batch_size` rows a batch, forever."""
    g = torch.Generator().manual_seed(settings.seed)
    while True:
        order = torch.randperm(len(sequences), generator=g).tolist()
        stream = torch.tensor([t for i in order for t in sequences[i]])
        rows = stream[: len(stream) // settings.seq_len * settings.seq_len].view(-1, settings.seq_len)
        rows = rows[torch.randperm(len(rows), generator=g)]
        for start in range(0, len(rows) - settings.batch_size + 1, settings.batch_size):
            yield rows[start:start + settings.batch_size]


def _lr(step: int, settings: LMSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _param_groups(params: list[torch.nn.Parameter], settings: LMSettings) -> list[dict]:
    """AdamW groups: vectors (norms, biases) without weight decay; matrices grouped by their
    learning-rate scale. Adam moves every weight by about lr per step whatever its fan-in, so a
    matrix reading many inputs changes its outputs that many times faster: the Kimi-style
    miniature's MLA `kv_b_proj` reads the 512-wide compressed KV, 8x the hidden size, and at one lr
    for all it learned ~1.6x slower per step (loss 4.86 vs 3.41 after 300 steps). With
    `lr_fan_in`, lr scales as 1/fan_in beyond it (as muP prescribes for hidden matrices under Adam)."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.dim() >= 2:
            scale = min(1.0, settings.lr_fan_in / p.shape[1]) if settings.lr_fan_in else 1.0
            groups.setdefault(scale, []).append(p)
    vectors = [p for p in params if p.dim() < 2]
    return ([{"params": ps, "weight_decay": settings.weight_decay, "lr_scale": scale} for scale, ps in groups.items()]
            + [{"params": vectors, "weight_decay": 0.0, "lr_scale": 1.0}])


class _TiedTailHead(torch.nn.Module):
    """The lm_head seen by the loss: one row per active id plus one shared row for all others."""

    def __init__(self, weight: torch.Tensor, active: torch.Tensor):
        super().__init__()
        vocab = weight.shape[0]
        self.active = active
        self.inactive_count = vocab - len(active)
        self.rows = torch.nn.Parameter(weight[active].clone())
        self.tail = torch.nn.Parameter(weight.mean(0, keepdim=True).clone()) if self.inactive_count else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., A(+1)]: logits over the active ids, then the shared row's + log(its multiplicity)."""
        logits = hidden @ self.rows.T
        if self.tail is None:
            return logits
        return torch.cat([logits, hidden @ self.tail.T + math.log(self.inactive_count)], dim=-1)

    def full_weight(self, vocab: int) -> torch.Tensor:
        weight = (self.tail.detach().expand(vocab, -1).clone() if self.tail is not None
                  else torch.zeros(vocab, self.rows.shape[1]))
        weight[self.active] = self.rows.detach()
        return weight


def train_miniature_lm(model: torch.nn.Module, sequences: list[list[int]], active_ids: list[int],
                       settings: LMSettings = LMSettings(), log=None) -> dict[str, float]:
    """Train `model` (a Hugging Face causal LM, `model.model` its body) in place as a next-token
    LM on `sequences`; `active_ids` are the ids its tokenizer can produce. Returns the first and
    last training loss."""
    torch.manual_seed(settings.seed)
    vocab = model.lm_head.weight.shape[0]
    active = torch.tensor(sorted(set(active_ids)))
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[active] = torch.arange(len(active))
    head = _TiedTailHead(model.lm_head.weight.detach().float(), active)
    body = model.model
    params = [p for p in body.parameters()] + list(head.parameters())
    optimizer = torch.optim.AdamW(_param_groups(params, settings), lr=settings.lr, betas=(0.9, 0.95))
    model.train()
    losses = []
    with _single_thread():
        for step, batch in zip(range(settings.steps), _batches(sequences, settings)):
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, settings) * group["lr_scale"]
            hidden = body(input_ids=batch).last_hidden_state[:, :-1]
            labels = remap[batch[:, 1:]]
            labels = torch.where(labels < 0, len(active), labels)  # an id outside the tokenizer's: the tail
            loss = torch.nn.functional.cross_entropy(head.logits(hidden).flatten(0, 1), labels.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(loss.item())
            if log is not None and (step % 50 == 0 or step == settings.steps - 1):
                log(f"lm step {step}: loss {loss.item():.4f}")
    with torch.no_grad():
        model.lm_head.weight.copy_(head.full_weight(vocab))
    model.eval()
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                         stop_ids: set[int]) -> list[list[int]]:
    """Plain greedy continuations (KV cache), used to check that a miniature writes text."""
    out = []
    for prompt in prompts:
        ids, cache, tokens = torch.tensor([prompt]), None, []
        while len(tokens) < max_new_tokens:
            step = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = step.past_key_values
            token = int(step.logits[0, -1].argmax())
            tokens.append(token)
            if token in stop_ids:
                break
            ids = torch.tensor([[token]])
        out.append(tokens)
    return out
