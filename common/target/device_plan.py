"""Planning `--device-map auto`: which GPU holds which block of the target, from real bytes.

A block is the embedding, one decoder layer, the final norm, the rotary table or the lm_head,
in forward order. Its size is what the loader will really hold: packed INT4 experts at their
packed size (int32 words + bf16 scales), every other floating tensor at the compute dtype.
Blocks go to the GPUs in order, each GPU filled up to about an even share of the total (so 8
GPUs each hold about 1/8) and never past its budget minus the headroom for activations. A target
that does not fit is refused with the bytes needed and available per device: nothing is ever
offloaded to the CPU or to disk, which would make a 1T-parameter forward pass take hours.
This module is pure arithmetic on sizes; only `gpu_budgets` looks at the hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from common.errors import PipelineError
from common.target.int4_experts import PackedLinear

GIB = 1024**3
ACTIVATION_SAFETY = 2.0  # allocator fragmentation and short-lived temporaries (softmax, casts, index_add)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|K|M|G|T|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
# A bare K/M/G/T is decimal, as disks are sold (a "5T" NVMe holds 5 x 10^12 bytes).
_UNITS = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class DevicePlanError(PipelineError, ValueError):
    """A device map that cannot be made; the message names what is needed and available."""


@dataclass(frozen=True)
class DevicePlan:
    placement: dict[str, str]  # block name -> device
    used: dict[str, int]  # device -> weight bytes placed on it
    budgets: dict[str, int]  # device -> budget in bytes
    headroom: int  # activation bytes reserved on every device

    def summary(self) -> str:
        return ", ".join(f"{d} {self.used.get(d, 0) / GIB:,.2f} GiB weights + {self.headroom / GIB:,.2f} GiB "
                         f"activations of {b / GIB:,.2f} GiB" for d, b in self.budgets.items() if self.used.get(d))


def parse_size(text: str, flag: str = "--max-memory") -> int:
    """'141GiB', '80GB', '1.5TiB', '1000000' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise DevicePlanError(f"{flag} {text!r}: expected a size such as 80GiB or 141GB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def parse_max_memory(text: str, devices: list[str]) -> dict[str, int]:
    """`--max-memory` as budgets per device: one size for every device ('130GiB') or
    per device index ('0=130GiB,1=100GiB'); devices not named get no budget (unused)."""
    if "=" not in text:
        size = parse_size(text)
        return dict.fromkeys(devices, size)
    budgets = {}
    for part in text.split(","):
        index, _, size = part.partition("=")
        name = f"cuda:{index.strip()}" if index.strip().isdigit() else index.strip()
        if name not in devices:
            raise DevicePlanError(f"--max-memory {text!r}: device {index.strip()!r} is not one of {devices}")
        budgets[name] = parse_size(size)
    return budgets


def gpu_budgets(max_memory: str | None) -> dict[str, int]:
    """Budget per visible GPU: `--max-memory`, or else each GPU's free memory now."""
    if not torch.cuda.is_available():
        raise DevicePlanError("--device-map auto: no GPU is visible; it places the target on GPUs only and never "
                              "offloads to CPU or disk (use --device cpu for a small target)")
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if max_memory:
        return parse_max_memory(max_memory, devices)
    return {d: torch.cuda.mem_get_info(d)[0] for d in devices}


def check_placement_flags(device_map: str | None, max_memory: str | None) -> dict[str, int] | None:
    """Refuse bad placement flags before any heavy work: `--max-memory` without `--device-map
    auto`, or `--device-map auto` with no GPU; the GPU budgets otherwise (None without a map)."""
    if max_memory and not device_map:
        raise DevicePlanError(f"--max-memory {max_memory}: only used with --device-map auto")
    return gpu_budgets(max_memory) if device_map else None


def block_sizes(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, int]]:
    """(name, bytes) of each placement block of a causal LM, in forward order: the children of
    `model.model` with its decoder layers one by one, then the other top-level children.
    Integer tensors and tensors of packed modules count at their own size, every other
    floating tensor at `dtype` (what the loader casts them to)."""

    def size(module: torch.nn.Module) -> int:
        total = 0
        for sub in module.modules():
            tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            for t in tensors:
                keep = isinstance(sub, PackedLinear) or not t.dtype.is_floating_point
                total += t.numel() * (t.element_size() if keep else dtype.itemsize)
        return total

    blocks = []
    for name, child in model.named_children():
        if name == "model":
            for sub_name, sub in child.named_children():
                if isinstance(sub, torch.nn.ModuleList):
                    blocks += [(f"model.{sub_name}.{i}", size(layer)) for i, layer in enumerate(sub)]
                else:
                    blocks.append((f"model.{sub_name}", size(sub)))
        else:
            blocks.append((name, size(child)))
    return blocks


def activation_headroom(text_config, batch_tokens: int, dtype: torch.dtype, logits: bool = False) -> int:
    """Bytes reserved on every device for one forward pass over `batch_tokens` padded tokens.

    Per token, one decoder layer at a time holds: the residual stream and its normed copy,
    attention's projections (q, k, v, output; MLA's compressed q and kv), the MLP's largest
    intermediate (the dense MLP, or top-k routed experts plus the shared one, gate/up/act), and
    02's three captured auxiliary states plus the final one. Add one dequantized expert matrix
    (the per-call transient of a packed layer), logits when the lm_head runs, and a 2x safety
    factor. SDPA attention is assumed (no [heads, S, S] score matrix)."""
    c = text_config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    qk = (getattr(c, "qk_nope_head_dim", 0) + getattr(c, "qk_rope_head_dim", 0)) or head_dim
    v = getattr(c, "v_head_dim", None) or head_dim
    lora = (getattr(c, "q_lora_rank", None) or 0) + (getattr(c, "kv_lora_rank", None) or 0) \
        + getattr(c, "qk_rope_head_dim", 0)
    moe = getattr(c, "moe_intermediate_size", 0) or 0
    routed = (getattr(c, "num_experts_per_tok", 0) or 0) + (getattr(c, "n_shared_experts", 0) or 0)
    mlp = 3 * max(getattr(c, "intermediate_size", 0) or 0, routed * moe)
    per_token = 2 * hidden + heads * (2 * qk + 2 * v) + lora + mlp + 4 * hidden
    transient = 3 * moe * hidden  # gate, up and down of one expert, dequantized
    total = (batch_tokens * per_token + transient) * dtype.itemsize
    if logits:
        total += batch_tokens * c.vocab_size * 4  # float32 logits
    return int(ACTIVATION_SAFETY * total)


def plan_device_map(blocks: list[tuple[str, int]], budgets: dict[str, int], headroom: int) -> DevicePlan:
    """Assign blocks in order to the devices of `budgets` (in their order), or refuse.

    First an even split: a block goes to the device whose equal slice of the total its middle
    byte falls in, so every device ends within half a block of total / devices. If that
    overflows a device's budget minus `headroom` (uneven budgets), devices are instead filled
    in order up to their room."""
    room = {d: b - headroom for d, b in budgets.items()}
    total = sum(size for _, size in blocks)
    largest = max((size for _, size in blocks), default=0)
    for placed in (_even(blocks, room), _fill(blocks, room)):
        if placed is not None:
            used: dict[str, int] = {}
            for name, size in blocks:
                used[placed[name]] = used.get(placed[name], 0) + size
            return DevicePlan(placed, used, dict(budgets), headroom)
    per_device = "; ".join(f"{d}: budget {b / GIB:,.2f} GiB, {max(room[d], 0) / GIB:,.2f} GiB left for weights "
                           f"after {headroom / GIB:,.2f} GiB of activations" for d, b in budgets.items())
    raise DevicePlanError(
        f"--device-map auto: the target needs {total / GIB:,.2f} GiB of weights (largest block "
        f"{largest / GIB:,.2f} GiB) plus {headroom / GIB:,.2f} GiB of activations per device; available: "
        f"{per_device}. Nothing is offloaded to CPU or disk: use more or larger GPUs, a larger --max-memory, "
        "or a smaller --batch-tokens")


def _even(blocks: list[tuple[str, int]], room: dict[str, int]) -> dict[str, str] | None:
    """Each block on the device whose slice of the total holds its middle byte; None if a
    device then holds more than its room."""
    devices = list(room)
    share = max(sum(size for _, size in blocks) / max(len(devices), 1), 1)
    placed, used, before = {}, dict.fromkeys(devices, 0), 0
    for name, size in blocks:
        device = devices[min(int((before + size / 2) // share), len(devices) - 1)]
        placed[name], before = device, before + size
        used[device] += size
    return placed if all(used[d] <= room[d] for d in devices) else None


def _fill(blocks: list[tuple[str, int]], room: dict[str, int]) -> dict[str, str] | None:
    """Blocks in order onto devices in order, each device up to its room; None if blocks are left."""
    devices = list(room)
    placed, index, used = {}, 0, 0
    for name, size in blocks:
        while index < len(devices) and used + size > room[devices[index]]:
            index, used = index + 1, 0
        if index == len(devices):
            return None
        placed[name] = devices[index]
        used += size
    return placed
