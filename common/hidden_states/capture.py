"""Capturing a target's hidden states for EAGLE-3 training (step 02).

Only four states are kept: three auxiliary layers and the post-norm final state. Layer id i
(vLLM convention, docs/FILES.md) is HF `hidden_states[i]`, the output of decoder layer i-1; a
forward hook on that layer keeps it. The final state is the output of the base model
(`model.model`, its final norm applied), so the 163840-wide logits are never computed and
`output_hidden_states` (all N+1 layers of a long batch held at once) is never used.

Samples are batched by length under a padded-token budget (`plan_batches`), right-padded with
an attention mask; padding sits after every real token, so under causal attention it changes
no real position. The plan depends only on the sample lengths and the budget: shards take
every k-th batch of one global plan, and a resumed run recomputes a whole planned batch, so a
sharded or resumed run does the same arithmetic as one uninterrupted run.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc
import torch
from tqdm import tqdm

from common.errors import PipelineError, first_line, skip_limit
from common.hidden_states.data_config import NUM_STATES
from common.hidden_states.journal import Journal, ids_digest
from common.hidden_states.state_files import file_digest, sample_path, save_sample
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES, StateStorage, StoredStates
from common.target.config import TargetInfo
from common.target.model import decoder_parts

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per forward pass (02 and 04 --online --batch-tokens)
WRITE_THREADS = 4  # file writes overlap the next forward pass
MAX_PENDING_WRITES = 64  # bounds the host memory held by finished, unwritten samples
# Skipping is for the odd bad sample; past `common.errors.skip_limit` or this many in a row the failures
# are systematic (a bug, a device that is out of memory on every sample) and the run stops.
MAX_SKIPPED_IN_A_ROW = 20


def choose_layer_ids(given: list[int] | None, info: TargetInfo) -> list[int]:
    """`--layer-ids`, or EAGLE-3's default auxiliary layers of the target, validated; a target too
    shallow for the defaults is told so (the user typed no ids)."""
    if given:
        return validate_layer_ids(given, info.num_layers)
    defaults = info.default_layer_ids()
    try:
        return validate_layer_ids(defaults, info.num_layers)
    except PipelineError as e:
        raise PipelineError(f"target {info.path}: EAGLE-3's default auxiliary layers [2, N//2, N-3] are {defaults} "
                            f"for its {info.num_layers} layers, not three distinct ids in 1..{info.num_layers - 1}; "
                            "pass --layer-ids with three") from e


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Three distinct auxiliary ids in 1..N-1 (N is the final state's place, 0 the embeddings)."""
    valid = f"three distinct ids in 1..{num_layers - 1} for a target with {num_layers} layers"
    if len(layer_ids) != 3 or len(set(layer_ids)) != 3:
        raise PipelineError(f"--layer-ids {' '.join(map(str, layer_ids))}: expected {valid}")
    bad = [i for i in layer_ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise PipelineError(f"--layer-ids {' '.join(map(str, layer_ids))}: {bad} out of range; expected {valid}")
    return list(layer_ids)


def check_token_ids(ds, num_rows: int, vocab_size: int) -> list[int]:
    """Lengths of the first `num_rows` rows; refuse ids outside the target's vocabulary (data
    prepared with another tokenizer), naming the first such sample."""
    table = ds.with_format("arrow")[:num_rows]
    ids = table.column("input_ids")
    bounds = pc.min_max(pc.list_flatten(ids)).as_py()
    if bounds["min"] is not None and (bounds["min"] < 0 or bounds["max"] >= vocab_size):
        row, bad = next((i, t) for i, r in enumerate(ids.to_pylist()) for t in r if not 0 <= t < vocab_size)
        sample_id = table.column("sample_id")[row].as_py()
        raise PipelineError(f"prepared sample {sample_id} (row {row}) holds token id {bad}, outside the target's "
                            f"vocabulary 0..{vocab_size - 1}: the data was prepared with another tokenizer; "
                            "re-run 01_prepare_data.py with this --target")
    return pc.list_value_length(ids).to_pylist()


def plan_batches(lengths: dict[int, int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of similar length whose padded size (batch size x
    longest sample) stays within `batch_tokens`; a longer sample gets a batch of its own.
    Longest first, so an out-of-memory batch shows up at the start of a run; ties by index."""
    batches: list[list[int]] = []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def shard_batches(batches: list[list[int]], num_shards: int, shard_index: int) -> list[list[int]]:
    """Every `num_shards`-th batch, from `shard_index`: disjoint shards whose union is the plan."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise PipelineError(f"--shard-index {shard_index} --num-shards {num_shards}: expected 0 <= index < shards")
    return batches[shard_index::num_shards]


@contextmanager
def capture_layers(layers: torch.nn.ModuleList, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks keeping the output of decoder layer i-1 as state i, for each requested id."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[i - 1].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class StateExtractor:
    """Runs batches through the base model and returns each sample's four states on the CPU,
    encoded for storage on the model's device (fp8 moves half the bytes off a GPU)."""

    PAD_ID = 0  # any valid id: padded positions come after every real token and are dropped

    def __init__(self, model: torch.nn.Module, layer_ids: list[int],
                 storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> None:
        self.base, self.layers = decoder_parts(model)
        self.layer_ids = layer_ids
        self.storage = storage
        self.device = self.base.get_input_embeddings().weight.device
        self.forward_seconds = 0.0

    @torch.inference_mode()
    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]:
        """Per sample: [aux states..., final state], each [S, H] encoded for storage on the CPU,
        each with its own storage (a view would save the whole batch into the file)."""
        longest = max(map(len, id_lists))
        ids = torch.full((len(id_lists), longest), self.PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sample in enumerate(id_lists):
            ids[row, :len(sample)] = torch.tensor(sample)
            mask[row, :len(sample)] = 1
        start = time.perf_counter()
        with capture_layers(self.layers, self.layer_ids) as captured:
            final = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                              use_cache=False).last_hidden_state
        _sync(final)
        self.forward_seconds += time.perf_counter() - start
        states, scales = self.storage.encode([captured[i] for i in self.layer_ids] + [final])
        states = [s.cpu() for s in states]
        scales = scales.cpu() if scales is not None else None
        return [StoredStates([s[row, :n].clone() for s in states],
                             scales[:, row, :n].clone() if scales is not None else None)
                for row, n in enumerate(map(len, id_lists))]


@dataclass
class Sample:
    index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class ExtractStats:
    written: dict[int, int] = field(default_factory=dict)  # index -> tokens
    failed: list[dict] = field(default_factory=list)  # {"index", "sample_id", "error"}
    file_bytes: int = 0
    state_bytes: int = 0  # bytes of the hidden-state tensors alone
    forward_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.written.values())


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# How an allocator says it is out of memory: CUDA's, and the CPU's ("DefaultCPUAllocator: can't
# allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)").
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _is_out_of_memory(error: RuntimeError | MemoryError) -> bool:
    text = str(error).lower()
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or any(w in text for w in OUT_OF_MEMORY_WORDS)


class ExtractionRun:
    """Extracts the planned batches of one shard into `out`, skipping the indices in `done`."""

    def __init__(self, extractor: StateExtractor, ds, out: Path, show_progress: bool = True,
                 journal: Journal | None = None) -> None:
        self.extractor = extractor
        self.journal = journal  # told of every file once it is in place (the next resume reads it)
        self.digests: dict[int, str] = {}  # ids digest of each sample being written
        self.rows = ds.select_columns(["sample_id", "input_ids", "loss_mask"])
        self.out = out
        self.show_progress = show_progress
        self.stats = ExtractStats()
        self.skip_limit = skip_limit(0)
        self.skipped_in_a_row = 0

    def run(self, batches: list[list[int]], done: set[int], lengths: dict[int, int]) -> ExtractStats:
        todo_tokens = sum(lengths[i] for batch in batches for i in batch if i not in done)
        todo_samples = sum(i not in done for batch in batches for i in batch)
        self.skip_limit = skip_limit(todo_samples)
        start = time.perf_counter()
        pending: deque[Future] = deque()
        bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="extract", disable=not self.show_progress,
                   smoothing=0.05)
        with ThreadPoolExecutor(WRITE_THREADS) as pool:
            for batch in batches:
                todo = [i for i in batch if i not in done]
                if not todo:
                    continue
                # The whole planned batch runs again even if some of it is done, so a resumed run
                # computes exactly what an uninterrupted one would.
                for sample, states in self.extract(self.load(batch)):
                    if sample.index in todo:
                        self.digests[sample.index] = ids_digest(sample.input_ids)
                        pending.append(pool.submit(_write, self.out, sample, states))
                while len(pending) > MAX_PENDING_WRITES:
                    self._collect(pending.popleft())
                bar.update(sum(lengths[i] for i in todo))
                bar.set_postfix(written=len(self.stats.written) + len(pending), failed=len(self.stats.failed))
            while pending:
                self._collect(pending.popleft())
        bar.close()
        self.stats.forward_seconds = self.extractor.forward_seconds
        self.stats.seconds = time.perf_counter() - start
        return self.stats

    def load(self, batch: list[int]) -> list[Sample]:
        """The prepared rows of `batch`; a row whose ids and mask differ in length is skipped and listed."""
        rows = self.rows[batch]
        samples = [Sample(i, str(sid), ids, mask) for i, sid, ids, mask
                   in zip(batch, rows["sample_id"], rows["input_ids"], rows["loss_mask"])]
        good = []
        for sample in samples:
            if not sample.input_ids or len(sample.loss_mask) != len(sample.input_ids):
                self._fail(sample, f"{len(sample.input_ids)} input ids but {len(sample.loss_mask)} loss-mask entries")
            else:
                good.append(sample)
        return good

    def extract(self, samples: list[Sample]) -> list[tuple[Sample, StoredStates]]:
        """The batch's states. Out of memory, the batch is split in halves down to single samples,
        and a sample out of memory alone is skipped and listed; any other error stops the run."""
        if not samples:
            return []
        try:
            states = self.extractor([s.input_ids for s in samples])
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            if not _is_out_of_memory(error):
                ids = ", ".join(s.sample_id for s in samples[:3]) + (", ..." if len(samples) > 3 else "")
                raise PipelineError(f"extraction failed on samples {ids}: {first_line(error)} "
                                    "(only out-of-memory errors are retried)") from error
            _free_device_memory()
            if len(samples) == 1:
                self._fail(samples[0], first_line(error))
                return []
            half = len(samples) // 2
            return self.extract(samples[:half]) + self.extract(samples[half:])
        self.skipped_in_a_row = 0
        return list(zip(samples, states))

    def _fail(self, sample: Sample, error: str) -> None:
        """Skip and list one sample; stop the run when skipping stops being the exception."""
        self.stats.failed.append({"index": sample.index, "sample_id": sample.sample_id, "error": error})
        self.skipped_in_a_row += 1
        tqdm.write(f"skipped sample {sample.sample_id} (row {sample.index}): {error}")
        failed = len(self.stats.failed)
        if failed > self.skip_limit or self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise PipelineError(f"{failed} samples skipped ({self.skipped_in_a_row} in a row, limit {self.skip_limit} "
                                f"in all and {MAX_SKIPPED_IN_A_ROW} in a row); the last, {sample.sample_id} "
                                f"(row {sample.index}): {error}. Files written so far are kept")

    def _collect(self, future: Future) -> None:
        """Account for one finished write (in the main thread; a write error stops the run)."""
        index, tokens, file_bytes, state_bytes, digest = future.result()
        self.stats.written[index] = tokens
        if self.journal is not None:
            self.journal.add(index, file_bytes, self.digests.pop(index), digest)
        self.stats.file_bytes += file_bytes
        self.stats.state_bytes += state_bytes


def _write(out: Path, sample: Sample, stored: StoredStates) -> tuple[int, int, int, int, str]:
    """Runs in a writer thread: (index, tokens, file bytes, hidden-state bytes incl. scales, the
    file's digest for the journal: `02 --verify` checks it; re-read from the page cache, a small
    cost beside the forward pass)."""
    size = save_sample(out, sample.index, torch.tensor(sample.input_ids, dtype=torch.long), stored.states,
                       torch.tensor(sample.loss_mask, dtype=torch.long), stored.scales)
    return sample.index, len(sample.input_ids), size, stored.nbytes, file_digest(sample_path(out, sample.index))


def estimate_bytes(tokens: int, samples: int, hidden_size: int,
                   storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> int:
    """Disk for `samples` files of `tokens` tokens in all: the four stored states (with their
    scales), the two int64 id/mask vectors, and a few kilobytes of zip and pickle overhead per file."""
    return tokens * (storage.bytes_per_token(NUM_STATES, hidden_size) + 16) + samples * 4096


@dataclass
class Verification:
    """Stored states against a plain forward of the target (`output_hidden_states=True`)."""
    tokens: int
    max_logit_diff: float  # |lm_head(stored final state) - the target's own logits|
    argmax_agreement: float  # share of positions where both pick the same token
    unexplained_mismatches: int  # argmax differences not within the logit error of a near-tie
    max_aux_error: float  # max |stored aux - hidden_states[i]|, relative to max |hidden_states[i]|


@torch.inference_mode()
def verify_samples(model: torch.nn.Module, states: list[tuple[list[int], list[torch.Tensor]]],
                   layer_ids: list[int]) -> Verification:
    """Check (input ids, [aux..., final]) pairs against the target: `lm_head(final)` must give
    the target's logits and aux state i must be HF `hidden_states[i]`."""
    tokens = agree = unexplained = 0
    max_diff = max_aux = 0.0
    device = model.get_input_embeddings().weight.device
    for ids, stored in states:
        out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
        own = out.logits[0].float()
        mine = model.lm_head(stored[-1].to(device, model.lm_head.weight.dtype)).float()
        diff = (own - mine).abs().max(dim=-1).values
        top, pick = own.argmax(-1), mine.argmax(-1)
        # A different pick is explained when the target itself rates it within the error of its top.
        gap = own.gather(-1, top[:, None])[:, 0] - own.gather(-1, pick[:, None])[:, 0]
        unexplained += int(((top != pick) & (gap > 2 * diff)).sum())
        agree += int((top == pick).sum())
        tokens += len(ids)
        max_diff = max(max_diff, float(diff.max()))
        for layer_id, state in zip(layer_ids, stored):
            ref = out.hidden_states[layer_id][0].float()
            max_aux = max(max_aux, float((state.to(ref.device).float() - ref).abs().max() / ref.abs().max()))
    return Verification(tokens, max_diff, agree / tokens, unexplained, max_aux)
