"""Upstream: tensorrt_llm/sampling_params.py (SamplingParams, GuidedDecodingParams).

Modelled: the dataclass(kw_only) signature (an unknown keyword is a TypeError), `max_tokens` default 32,
`_validate` (best_of >= n; greedy decoding may not return several sequences), `params_imply_greedy_decoding`
(greedy when temperature, top_p and top_k are all unset, or top_k == 1, top_p == 0.0 or temperature == 0),
and `_setup(tokenizer)` turning stop strings into `_stop_word_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, List[str]]] = None
    bad_token_ids: Optional[List[int]] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    min_p: Optional[float] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    guided_decoding: Optional[GuidedDecodingParams] = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    _stop_word_ids: Optional[List[List[int]]] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        self._validate()

    def _validate(self) -> None:
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.best_of > 1 and self._greedy_decoding:
            raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        self.logprobs = self.logprobs and int(self.logprobs)

    @staticmethod
    def params_imply_greedy_decoding(*, temperature, top_p, top_k) -> bool:
        return ((temperature is None and top_p is None and top_k is None) or top_k == 1 or top_p == 0.0
                or temperature == 0)

    @property
    def _greedy_decoding(self) -> bool:
        return not self.use_beam_search and self.params_imply_greedy_decoding(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def _setup(self, tokenizer) -> "SamplingParams":
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id
        if self.stop is not None:
            strs = [self.stop] if isinstance(self.stop, str) else self.stop
            self._stop_word_ids = [tokenizer.encode(s, add_special_tokens=False) for s in strs]
        return self

    def _get_stop_reasons_and_words(self):
        words = []
        if self.stop_token_ids:
            words += [(t, [t]) for t in self.stop_token_ids]
        if self.stop is not None:
            strs = [self.stop] if isinstance(self.stop, str) else self.stop
            words += list(zip(strs, self._stop_word_ids or []))
        return words
