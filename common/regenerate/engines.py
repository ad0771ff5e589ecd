"""The engines step 00 generates with: the target in this process (transformers, batched), a
vLLM engine it starts in vLLM's own environment (`common.vllm.client`'s worker, every prompt of a
round in flight at once), or a running vLLM server given by URL (its OpenAI completions API, token
ids in and out, `--max-in-flight` requests at once). Each takes token-id prompts and returns each
generation cut at the first stop token, with whether it stopped or hit the token limit."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from common.engine_device import Runtime
from common.errors import PipelineError
from common.regenerate.options import RegenerateOptions
from common.regenerate.turns import Completion, Engine
from common.target.config import TargetInfo
from common.target.model import load_text_model
from common.vllm.client import EngineSettings, VllmWorker

__all__ = ["HfEngine", "VllmGenerateEngine", "VllmServerEngine", "open_engine"]
REQUEST_TIMEOUT = 3600  # seconds for one completion (a long thinking answer on a busy server)


def _completion(tokens: list[int], stop_ids: set[int], stopped: bool | None = None) -> Completion:
    """Cut at the first stop token; `stopped` overrides the check (vLLM reports why it ended)."""
    for n, token in enumerate(tokens):
        if token in stop_ids:
            return Completion(tokens[:n], True)
    return Completion(tokens, bool(stopped))


class HfEngine:
    """The target in this process (transformers), batches of left-padded prompts of similar length."""

    def __init__(self, model: torch.nn.Module, stop_ids: set[int], pad_id: int, temperature: float, top_p: float,
                 batch_size: int):
        self.model, self.stop_ids, self.pad_id, self.batch_size = model, stop_ids, pad_id, batch_size
        self.temperature, self.top_p = temperature, top_p

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
        sampled = self.temperature > 0
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id,
            do_sample=sampled, temperature=self.temperature if sampled else None,
            top_p=self.top_p if sampled else None, top_k=0 if sampled else None)
        torch.manual_seed(seed)  # sampled runs repeat exactly for the same inputs and batches
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding
        out: dict[int, Completion] = {}
        for start in range(0, len(order), self.batch_size):
            chosen = order[start:start + self.batch_size]
            for i, tokens in zip(chosen, self._batch([prompts[i] for i in chosen], config)):
                out[i] = _completion(tokens, self.stop_ids)
        return [out[i] for i in range(len(prompts))]

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], config) -> list[list[int]]:
        width = max(map(len, prompts))
        device = self.model.get_input_embeddings().weight.device
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        generated = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return generated[:, width:].tolist()


class VllmGenerateEngine:
    """A running vLLM worker's `generate` op: one request per prompt, seeded per request, stopped
    at the generation config's eos ids too (as the target is served)."""

    def __init__(self, worker, stop_ids: set[int], temperature: float, top_p: float):
        self.worker, self.stop_ids = worker, stop_ids
        self.temperature, self.top_p = temperature, top_p

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
        answer = self.worker.request({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens,
                                      "stop_ids": sorted(self.stop_ids), "temperature": self.temperature,
                                      "top_p": self.top_p, "seed": seed, "ignore_eos": False},
                                     f"generating {len(prompts)} turns")
        return [_completion(tokens, self.stop_ids, stopped) for tokens, stopped in
                zip(answer["outputs"], answer["stopped"])]


class VllmServerEngine:
    """A vLLM server started by the user (`vllm serve TARGET ...`): `/v1/completions` with the
    prompt as token ids, `return_token_ids` for the generated ids, one request per prompt (seed
    + i), up to `max_in_flight` at once so the server batches them."""

    def __init__(self, url: str, stop_ids: set[int], temperature: float, top_p: float, max_in_flight: int):
        self.url, self.stop_ids, self.max_in_flight = url.rstrip("/"), stop_ids, max_in_flight
        self.temperature, self.top_p = temperature, top_p
        models = self._call("/v1/models", None).get("data") or []
        if not models:
            raise PipelineError(f"--vllm-url {self.url}: the server lists no model")
        self.model = models[0]["id"]

    def _call(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise PipelineError(f"--vllm-url {self.url}{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PipelineError(f"--vllm-url {self.url}{path}: {e}") from e

    def _one(self, prompt: list[int], max_new_tokens: int, seed: int) -> Completion:
        answer = self._call("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": seed, "stop_token_ids": sorted(self.stop_ids), "return_token_ids": True,
            "skip_special_tokens": False})
        choice = answer["choices"][0]
        if choice.get("token_ids") is None:
            raise PipelineError(f"--vllm-url {self.url}: the server returns no token ids (vLLM 0.11 or later needed)")
        return _completion(list(choice["token_ids"]), self.stop_ids, choice.get("finish_reason") == "stop")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]:
        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, max(len(prompts), 1))) as pool:
            return list(pool.map(lambda ip: self._one(ip[1], max_new_tokens, seed + ip[0]), enumerate(prompts)))


@contextmanager
def open_engine(options: RegenerateOptions, tokenizer, info: TargetInfo, trust_remote_code: bool, runtime: Runtime,
                max_in_flight: int = 256) -> Iterator[Engine]:
    """The engine `runtime` names, loaded once and closed on leaving."""
    if runtime.vllm_url:
        yield VllmServerEngine(runtime.vllm_url, set(info.stop_ids), options.temperature, options.top_p, max_in_flight)
        return
    if runtime.vllm:
        settings = EngineSettings.for_target(info, options.max_prompt_len + options.max_new_tokens,
                                             trust_remote_code, runtime.tensor_parallel_size, runtime.vllm_dtype)
        with VllmWorker(runtime.vllm_python, settings) as worker:
            print(f"vLLM {worker.version} started in {worker.start_seconds:.1f}s")
            yield VllmGenerateEngine(worker, set(info.stop_ids), options.temperature, options.top_p)
        return
    model = load_text_model(info, runtime.dtype, runtime.device, None, logits=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(info.stop_ids)
    yield HfEngine(model, set(info.stop_ids), pad_id, options.temperature, options.top_p, options.batch_size)
