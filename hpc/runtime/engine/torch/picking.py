"""How the torch engine chooses a sequence's next token from its logits.

Per row, in order: the repetition penalty, presence/frequency penalties, the canned-answer test knob, the guide,
then greedy or sampling;
logprobs report the model's own distribution (before penalties and masks). Rows that need none of this take the
step's batched path instead (`batchable`: one argmax or one sampling kernel for all of them).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc.runtime.engine.guided import vocabulary_texts
from hpc.runtime.engine.torch.sampling import guided_order, on_device, sample, sample_rows, token_logprob
from hpc.runtime.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from hpc.runtime.engine.torch.sequence import Seq


class TokenPicker:
    def __init__(self, model_dir: Path, eos_token_id: int, max_len: int, canned_completion: str | None) -> None:
        self.model_dir = model_dir
        self.eos = eos_token_id
        self.max_len = max_len
        self._texts: list[str | None] | None = None  # guided decoding's view of the vocabulary
        # A test knob (recipe `model.canned_completion`): every answer is this text, then EOS, produced through the
        # real sampler with all other tokens masked, so tool-call and reasoning markup can be tested end to end on
        # a random-weight model.
        self.canned = self.tokenizer().encode(str(canned_completion), add_special_tokens=False).ids \
            if canned_completion else None

    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))

    def batchable(self, p: SamplingParams) -> bool:
        return p.logprobs is None and p.seed is None and self.canned is None and p.guide is None \
            and not (p.presence_penalty or p.frequency_penalty) and p.repetition_penalty == 1.0

    def pick_rows(self, seqs: list["Seq"], logits: torch.Tensor,
                  sampler: torch.Generator) -> list[tuple[int, TokenLogprob | None]]:
        """Each row's next token. The `batchable` rows: one argmax for the greedy ones and one sampling kernel
        (drawing from `sampler`) for the others (pick_on_device), read back in one sync, not one per row (at 64
        rows the per-row syncs cost more than the decode step itself)."""
        plain = [i for i, s in enumerate(seqs) if self.batchable(s.request.sampling)]
        picked: dict[int, tuple[int, TokenLogprob | None]] = {}
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[plain]
            tokens = self.pick_on_device([seqs[i] for i in plain], rows, sampler).tolist()
            picked = {i: (t, None) for i, t in zip(plain, tokens)}
        return [picked[i] if i in picked else self.pick(s, logits[i]) for i, s in enumerate(seqs)]

    def pick_on_device(self, seqs: list["Seq"], logits: torch.Tensor, sampler: torch.Generator) -> torch.Tensor:
        """pick_rows for rows that are all `batchable`, without reading the tokens: [rows] on the logits' device
        (an overlapped step's tokens, the next step's input)."""
        greedy = [i for i, s in enumerate(seqs) if s.request.sampling.temperature == 0]
        if len(greedy) == len(seqs):
            return logits.argmax(-1)
        if not greedy:
            return sample_rows(logits, [s.request.sampling for s in seqs], sampler)
        sampled = [i for i, s in enumerate(seqs) if s.request.sampling.temperature > 0]
        where_greedy, where_sampled = on_device(greedy, logits.device), on_device(sampled, logits.device)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        tokens[where_greedy] = logits[where_greedy].argmax(-1)
        tokens[where_sampled] = sample_rows(logits[where_sampled], [seqs[i].request.sampling for i in sampled],
                                            sampler)
        return tokens

    def pick(self, seq: "Seq", logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        raw = logits
        p = seq.request.sampling
        if p.repetition_penalty != 1.0:
            logits = repetition_penalised(logits, seq, p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.counts:
            # OpenAI's definition: logit - frequency * count - presence * (count > 0), over generated tokens
            ids = torch.tensor(list(seq.counts), device=logits.device)
            times = torch.tensor(list(seq.counts.values()), dtype=logits.dtype, device=logits.device)
            logits = logits if logits is not raw else logits.clone()
            logits[ids] -= p.frequency_penalty * times + p.presence_penalty
        if self.canned is not None:
            step = seq.generated
            target = self.canned[step] if step < len(self.canned) else self.eos
            forced = torch.full_like(logits, float("-inf"))
            forced[target] = logits[target]
            logits = forced
        token = self._guided(seq, logits) if seq.guide is not None else sample(logits, p, seq.gen)
        return token, (None if p.logprobs is None else token_logprob(raw, token, p.logprobs))

    def _guided(self, seq: "Seq", logits: torch.Tensor) -> int:
        """The best-ranked token that keeps the output inside its guide and closable in the tokens left (see
        guided); EOS when none fits (a max_tokens below the guide's minimum)."""
        automaton, state = seq.guide
        p = seq.request.sampling
        left = min(p.max_tokens - seq.generated, self.max_len - seq.length - 1) - 1  # after this token
        fit = automaton.first_fit(state, guided_order(logits, p, seq.gen), self.token_texts(),
                                  {self.eos, *p.stop_token_ids}, left)
        if fit is None:
            return self.eos
        seq.guide = (automaton, fit[1])
        return fit[0]

    def token_texts(self) -> list[str | None]:
        if self._texts is None:  # built on the first guided request
            self._texts = vocabulary_texts(self.tokenizer())
        return self._texts


def repetition_penalised(logits: torch.Tensor, seq: "Seq", penalty: float) -> torch.Tensor:
    """vLLM's and Hugging Face's repetition penalty (TensorRT-LLM's `repetition_penalty`): every token of the
    prompt or the answer so far has its logit divided by `penalty` where positive and multiplied where negative,
    so > 1 makes any repeat less likely, whatever its sign. A copy: logprobs report the model's own."""
    ids = torch.tensor(sorted({*seq.request.token_ids, *seq.counts}), device=logits.device)
    seen = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out
