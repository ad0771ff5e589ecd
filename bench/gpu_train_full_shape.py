"""GPU check of step 04 at Kimi-K2.5's full draft shape: a few training steps of the draft of
configs/draft_kimi_k25.json (hidden 7168, 64 heads of 128, intermediate 18432, target vocabulary
163840, draft vocabulary 32000) on sequences of 2048 tokens, through speculators' Trainer with
the project's patch, on synthetic hidden states. Prints tokens per second and peak GPU memory.

    python bench/gpu_train_full_shape.py [--steps 8] [--seq-len 2048] [--no-compile] [--out DIR]
    python bench/gpu_train_full_shape.py --device cpu --draft-config SMALL.json --steps 2 --seq-len 256
        # a dry run of the plumbing on CPU with a small draft config (hidden size from the file)

No Kimi-K2.5 checkpoint is needed: a stand-in target folder (a Kimi-shaped text config with
yarn rope, and only the two tensors the draft reads, embed_tokens and lm_head, in bf16) is
written to --out first. The first two steps (compilation, allocator warm-up) are not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from common.draft import patch  # noqa: E402
from common.draft.model import KIMI_CONFIG, build_draft, read_config_file, speculator_config  # noqa: E402
from common.fixtures.targets import KIMI_TEXT_CONFIG, KIMI_VOCAB_SIZE  # noqa: E402
from common.target.config import load_target_info  # noqa: E402
from common.train.settings import TrainSettings  # noqa: E402
from common.train.trainer import trainer_config  # noqa: E402
from common.vocab import build_maps  # noqa: E402

WARMUP_STEPS = 2
# Kimi-K2.5's text config (README, "Kimi-K2.5 on an 8-GPU host"), flat, as the draft sees it; hidden size from the draft config.
STANDIN_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
    "num_attention_heads": 64, "vocab_size": KIMI_VOCAB_SIZE, "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "rope_scaling": KIMI_TEXT_CONFIG["rope_scaling"], "max_position_embeddings": 262144,
    "pad_token_id": 163839, "tie_word_embeddings": False,
}


def write_standin_target(folder: Path, hidden: int, device: torch.device) -> Path:
    """config.json plus model.safetensors holding only embed_tokens and lm_head (bf16)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**STANDIN_CONFIG, "hidden_size": hidden}))
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {name: (torch.randn(KIMI_VOCAB_SIZE, hidden, generator=g, device=device) * 0.02).bfloat16().cpu()
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def synthetic_batches(steps: int, seq_len: int, hidden: int, samples_per_seq: int = 4) -> list[dict]:
    """Collated batches as `create_collate_fn` makes them: [1, seq_len, ...] with packed lengths."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((samples_per_seq,), seq_len // samples_per_seq, dtype=torch.long)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0)
    return [{"hidden_states": torch.randn(1, seq_len, 3 * hidden, generator=g),
             "input_ids": torch.randint(0, 150000, (1, seq_len), generator=g),
             "verifier_last_hidden_states": torch.randn(1, seq_len, hidden, generator=g),
             "loss_mask": torch.ones(1, seq_len, dtype=torch.long), "lengths": lengths,
             "position_ids": positions} for _ in range(steps)]


class TimedBatches(list):
    """Batches for `Trainer.train_epoch` that record when each step asks for its batch."""

    batch_sampler = None

    def __iter__(self):
        self.times = []
        for batch in super().__iter__():
            self.times.append(_now())
            yield batch
        self.times.append(_now())


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    from speculators.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu04"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft-config", type=Path, default=KIMI_CONFIG)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device")

    patch.apply(compile_forward=device.type == "cuda" and not args.no_compile)
    config_file = read_config_file(args.draft_config)
    hidden = config_file.model.hidden_size
    target = write_standin_target(args.out / "target", hidden, device)
    info = load_target_info(target, trust_remote_code=True)
    settings, _ = TrainSettings.resolve(config_file, {"total_seq_len": args.seq_len, "scheduler": "none"})
    counts = torch.arange(KIMI_VOCAB_SIZE, 0, -1)  # any fixed choice of 32000 ids
    d2t, t2d = build_maps(counts, config_file.model.draft_vocab_size)
    config = speculator_config(config_file.model, info, d2t.numel(), [2, 30, 58], settings.ttt_steps)
    torch.manual_seed(0)
    model = build_draft(config, t2d, d2t)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = TimedBatches(synthetic_batches(args.steps + WARMUP_STEPS, args.seq_len, hidden))
    trainer = Trainer(model, trainer_config(settings, args.out / "checkpoints", False, False, device), batches, None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train_epoch(0)
    step_seconds = [b - a for a, b in zip(batches.times[WARMUP_STEPS:], batches.times[WARMUP_STEPS + 1:])]
    median = statistics.median(step_seconds)
    compiled = device.type == "cuda" and not args.no_compile
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"draft: hidden {hidden}, intermediate {config_file.model.intermediate_size}, draft vocab {d2t.numel():,} "
          f"of {KIMI_VOCAB_SIZE:,}, {trainable:,} trainable parameters, compiled forward: {compiled}")
    print(f"{args.steps} timed steps of {args.seq_len} tokens x {settings.ttt_steps} TTT steps on {where}: "
          f"median {median * 1000:.0f} ms/step, {args.seq_len / median:,.0f} tok/s")
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
              f"(reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB)")


if __name__ == "__main__":
    main()
