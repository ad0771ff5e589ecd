"""How step 02 stores hidden states, and how 04 and 05 read them back.

Two storages, chosen with `02 --storage` and recorded in `data_config.json`:

- `bf16` (the default): speculators' v1 sample as it is, `"hidden_states": [bf16[S, H]] * 4`.
- `fp8`: the same keys with each state in float8 e4m3 (`float8_e4m3fn`, largest value 448),
  plus `"hidden_state_scales": bf16[4, S]`, one scale per token row of each state:
  `state[k][t] = hidden_states[k][t].float() * hidden_state_scales[k, t]`. A row's scale maps
  its largest magnitude onto 448, so residual-stream outliers in the thousands keep their value
  (an unscaled cast saturates them at 448) and e4m3's exponent keeps the small entries of the
  same row at e4m3's relative precision (3 mantissa bits: at most 1/16 per entry). Scales are
  rounded to bf16 *before* quantizing, so what is stored is exactly what was divided by.

Bytes per token and state: H x 2 (bf16) against H + 2 (fp8); 0.5001 of bf16 at Kimi-K2.5's
hidden size 7168. The library's `Eagle3SampleFileDataset` reads both: 04 and 05 pass
`standardize_fn(storage)`, which dequantizes fp8 files in the loader (no second copy on disk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import PipelineError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_DTYPE = torch.bfloat16
SCALES_KEY = "hidden_state_scales"
V1_KEYS = frozenset({"input_ids", "hidden_states", "loss_mask"})


@dataclass
class StoredStates:
    """One sample's four states as stored ([S, H] each) and their fp8 scales ([4, S]) if any."""

    states: list[torch.Tensor]
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = self.states + ([self.scales] if self.scales is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class StateStorage:
    """One way of storing the four states of a sample."""

    name: str  # the value of 02 --storage and of data_config.json's `storage`
    dtype: torch.dtype  # of the stored states
    scaled: bool  # per-row scales stored under SCALES_KEY

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def keys(self) -> frozenset[str]:
        return V1_KEYS | {SCALES_KEY} if self.scaled else V1_KEYS

    def bytes_per_token(self, num_states: int, hidden_size: int) -> int:
        """Bytes of the stored states (and their scales) per token."""
        scale = SCALE_DTYPE.itemsize if self.scaled else 0
        return num_states * (hidden_size * self.dtype.itemsize + scale)

    def encode(self, states: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(stored states, scales [num_states, ...rows] or None) of states [..., H] of any float
        dtype, on their own device; a caller moves the (smaller) result to the CPU."""
        if not self.scaled:
            return [s.to(self.dtype) for s in states], None
        pairs = [quantize_rows(s) for s in states]
        return [q for q, _ in pairs], torch.stack([scale for _, scale in pairs])

    def decode(self, data: dict[str, Any]) -> list[torch.Tensor]:
        """The states of a loaded sample: bf16 as stored, fp8 dequantized to float32."""
        if not self.scaled:
            return list(data["hidden_states"])
        scales = data[SCALES_KEY]
        return [dequantize_rows(q, scales[k]) for k, q in enumerate(data["hidden_states"])]

    def holds(self, data: Any, num_states: int, shape: tuple[int, int]) -> bool:
        """True when a loaded sample has this storage's keys (others may be there too), states and
        scales of `shape` [S, H]."""
        if not isinstance(data, dict) or not self.keys <= set(data):
            return False
        states = data["hidden_states"]
        if not (isinstance(states, list) and len(states) == num_states
                and all(isinstance(s, torch.Tensor) and s.dtype == self.dtype and tuple(s.shape) == shape
                        for s in states)):
            return False
        scales = data.get(SCALES_KEY)
        return not self.scaled or (isinstance(scales, torch.Tensor) and scales.dtype == SCALE_DTYPE
                                   and tuple(scales.shape) == (num_states, shape[0]))


STORAGES = {s.name: s for s in (StateStorage("bf16", torch.bfloat16, scaled=False),
                                StateStorage("fp8", FP8_DTYPE, scaled=True))}
DEFAULT_STORAGE = "bf16"
FP32_CHECK = StateStorage("fp32", torch.float32, scaled=False)  # exact capture for checks; not a user choice


def get_storage(name: str) -> StateStorage:
    if name not in STORAGES:
        raise PipelineError(f"hidden-state storage {name!r}: expected one of {', '.join(STORAGES)}")
    return STORAGES[name]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, bf16 scale per row) of `x` [..., H]: each row divided by its scale, the
    bf16-rounded max |row| / 448 (1 for an all-zero row). The clamp only catches the rounding of
    the scale below the exact quotient; torch's CUDA cast would turn a value past 448 into NaN."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(SCALE_DTYPE)
    q = (x / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 rows `q` [..., H] with their scales [...]."""
    return q.float() * scale.float()[..., None]


def standardize_fp8(data: dict[str, Any]) -> dict[str, Any]:
    """`standardize_data_v1` of an fp8 sample: its states dequantized first (float32)."""
    from speculators.train.data import standardize_data_v1  # imported late: 02 never needs speculators

    states = STORAGES["fp8"].decode(data)
    return standardize_data_v1({"input_ids": data["input_ids"], "hidden_states": states,
                                "loss_mask": data["loss_mask"]})


def standardize_fn(storage: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What 04 and 05 pass to the library's dataset for a folder of this storage."""
    from speculators.train.data import standardize_data_v1  # imported late: 02 never needs speculators

    return standardize_fp8 if get_storage(storage).scaled else standardize_data_v1
