"""Stop strings, enforced on the coordinator.

A ``--tokens-only`` engine has no detokenizer, so it rejects ``stop`` (400). Native ``vllm serve``
checks stop strings in its incremental detokenizer (``vllm/v1/engine/detokenizer.py``); this is the
same rule applied to derender's text deltas:

* only text produced after ``min_tokens`` output tokens is searched;
* the stop string that *completes earliest* wins (ties: list order);
* the text is cut before the stop string (or after it with ``include_stop_str_in_output``);
* while streaming, the last ``max(len(stop)) - 1`` characters are held back so a partial stop
  string never reaches the client;
* generation ends with ``finish_reason="stop"`` and ``stop_reason=<the string>``; tokens after the
  one that completed it are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.pipeline.context import StopSpec


@dataclass
class StopResult:
    """What one text delta becomes after stop-string processing."""

    text: str
    stop: str | None = None


@dataclass
class StopMatcher:
    """Incremental matcher for one choice. Feed each text delta with the number of tokens it covers."""

    spec: StopSpec
    _text: str = ""          # all text seen so far (needed to search across delta boundaries)
    _emitted: int = 0        # characters of _text already released to the client
    _tokens: int = 0
    stopped: str | None = field(default=None)

    def feed(self, delta: str, num_tokens: int) -> StopResult:
        """Add a delta; return what may be released now (hold-back applied) and the stop, if hit."""
        if self.stopped is not None:
            return StopResult("")
        prev_tokens = self._tokens
        self._tokens += num_tokens
        search_from = len(self._text)
        self._text += delta
        if not self.spec.active:
            return self._release(len(self._text))
        if self._tokens <= self.spec.min_tokens:
            return self._release(len(self._text) - self.spec.holdback)
        if prev_tokens < self.spec.min_tokens:
            # Text of the tokens inside min_tokens is never searched; with one token per chunk the whole
            # delta belongs to the first searchable token, as in vLLM's per-step check.
            search_from = len(self._text) - len(delta)
        hit = _earliest_stop(self._text, search_from, self.spec.strings)
        if hit is None:
            return self._release(len(self._text) - self.spec.holdback)
        stop, start = hit
        end = start + len(stop) if self.spec.include_in_output else start
        self.stopped = stop
        self._text = self._text[:end]
        return StopResult(self._release(end).text, stop)

    def flush(self) -> str:
        """Release everything held back (the engine finished on its own)."""
        return self._release(len(self._text)).text

    def _release(self, upto: int) -> StopResult:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted:upto]
        self._emitted = upto
        return StopResult(out)


def _earliest_stop(text: str, new_from: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """Find the stop string completing earliest in ``text`` that ends after ``new_from``."""
    best: tuple[str, int] | None = None
    best_end = len(text) + 1
    for s in stops:
        if not s:
            continue
        idx = text.find(s, max(0, new_from - len(s) + 1))
        if idx == -1:
            continue
        end = idx + len(s)
        if end < best_end:
            best, best_end = (s, idx), end
    return best


def truncate_at_stop(text: str, spec: StopSpec) -> tuple[str, str | None]:
    """Batch form: cut a complete text at its earliest-completing stop string."""
    hit = _earliest_stop(text, 0, spec.strings)
    if hit is None:
        return text, None
    stop, start = hit
    return (text[: start + len(stop)] if spec.include_in_output else text[:start]), stop
