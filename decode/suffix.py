"""Training-free suffix drafting (after SuffixDecoding, arXiv 2411.04975): propose what followed the longest earlier
match of the text's end, from the prompt and the answer so far, and optionally from a corpus.

Each step the context is prompt + emitted tokens, ending with the root (``state.next_token``).

- **Local index** (:class:`NgramIndex`): every n-gram (n <= ``max_match``) of the context, mapped to the positions
  that followed its occurrences; updated with each step's new tokens. The longest n whose last-n-gram occurred
  before is found by binary search over n (an n-gram that occurred implies its suffixes did too).
- **Corpus index** (:class:`SuffixArray`): a suffix array over a token corpus (the target's own answers from
  scripts/regenerate.py, any jsonl or text file), sorted on the first ``SORT_DEPTH`` tokens; the suffixes that start
  with a pattern are one contiguous range, found by binary search. Built once with numpy and cached.
- **History** (``remember``): the answers this drafter decoded earlier in the process (the newest ``remember``
  tokens), indexed like a corpus, as SuffixDecoding's global tree of past outputs: a server's later requests, a
  benchmark's later prompts, draft from what the target wrote before. The index is rebuilt at the start of a
  generation once the answers not yet in it reach an eighth of its size (so rebuilding costs a few operations per
  token however long the process runs).
- **Candidates**: the continuations (up to ``max_depth`` tokens) after each occurrence, most recent first, form a
  trie. A node's score is the share of occurrences whose continuation starts with its path (so a child never scores
  above its parent); the sources (context, corpus, history) are combined by taking each node's larger score.
- **How many to verify** (``budget=auto``): scores are scaled into acceptance probabilities per match length and
  depth from what was accepted so far (:class:`selfspec.decode.adaptive.Calibration`: a single earlier occurrence scores
  every token of its continuation alike, but the deeper a node the less often its whole branch is accepted), and
  nodes are verified best probability first, as many as maximise expected tokens per second under this machine's
  verify cost curve; no node (plain decoding) when nothing is worth it. A number instead of ``auto`` verifies the best ``budget`` nodes every step.

Drafts are deterministic, so both greedy and sampling verification stay lossless (``probs=None``: point masses).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from selfspec.core.folders import cache_dir
from selfspec.decode.adaptive import Calibration, CostCurve, best_size, measured_cost_curve
from selfspec.decode.tree import Tree
from selfspec.decode.types import DecodeSetupError, DecodeState, Draft, DrafterBase, ForwardOutput
from selfspec.decode.verify import Verdict

SORT_DEPTH = 64  # the corpus suffix array is sorted on this many leading tokens; longer matches are not needed
SEPARATOR = -1  # between corpus documents: never matched, never proposed


# --- the local index ------------------------------------------------------------------------------------------------


class NgramIndex:
    """The n-grams (n = 1 .. max_n) of a growing token sequence -> the positions right after each occurrence."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.follows.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def longest_match(self, extra: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(n, positions) for the longest n whose last-n-gram occurred before, with the positions right after those
        occurrences; (0, []) if even the last token is new. ``extra``: for the sequence followed by these tokens,
        which it does not hold (another drafter's guess); the index is unchanged, and an occurrence ending at the
        sequence's own end is left out (nothing follows it yet)."""
        end = len(self.tokens)
        tail = self.tokens[-self.max_n:] + [int(t) for t in extra]

        def earlier(n: int) -> list[int]:
            hits = self.follows.get(tuple(tail[-n:]), [])
            return hits[:-1] if hits and hits[-1] >= end else hits

        lo, hi = 0, min(self.max_n, end + len(extra) - 1)
        while lo < hi:  # invariant: length lo matches (0 trivially); find the largest that does
            mid = (lo + hi + 1) // 2
            if earlier(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo, (earlier(lo) if lo else [])

    def continuations(self, positions: list[int], depth: int, limit: int) -> list[list[int]]:
        """The ``depth`` tokens after each of the last ``limit`` positions, most recent first."""
        return [self.tokens[p:p + depth] for p in reversed(positions[-limit:])]


# --- the corpus index -----------------------------------------------------------------------------------------------


def suffix_array(tokens: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Start positions of ``tokens``' suffixes sorted on their first ``depth`` tokens (prefix doubling in numpy)."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    order = np.argsort(rank, kind="stable")
    k = 1
    while k < depth and n > 1:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] + 1  # 0: past the end, sorts first
        key = rank * (n + 1) + second
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        if rank[order[-1]] == n - 1:  # every suffix is told apart
            break
        k *= 2
    return order


@dataclass
class SuffixArray:
    """A token corpus (documents joined by SEPARATOR) and its suffix array."""

    tokens: np.ndarray  # [T] int32
    order: np.ndarray  # [T] int64, suffix start positions sorted

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]]) -> "SuffixArray":
        parts = []
        for doc in documents:
            parts.append(np.asarray(doc, dtype=np.int32))
            parts.append(np.array([SEPARATOR], dtype=np.int32))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return cls(tokens=tokens, order=suffix_array(tokens))

    def save(self, path: Path) -> None:
        fd, name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:  # a name of its own: two processes saving one index at once both finish
            np.savez(f, tokens=self.tokens, order=self.order)
        os.replace(name, path)

    @classmethod
    def load(cls, path: Path) -> "SuffixArray":
        with np.load(path) as data:
            return cls(tokens=data["tokens"], order=data["order"])

    def _bound(self, pattern: tuple[int, ...], upper: bool) -> int:
        m, lo, hi = len(pattern), 0, len(self.order)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(self.order[mid])
            prefix = tuple(self.tokens[start:start + m].tolist())
            if prefix < pattern or (upper and prefix == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The range of sorted suffixes that start with ``pattern`` (at most SORT_DEPTH tokens)."""
        key = tuple(int(t) for t in pattern)
        return self._bound(key, upper=False), self._bound(key, upper=True)

    def longest_match(self, context: Sequence[int], max_n: int) -> tuple[int, tuple[int, int]]:
        """(n, range) for the longest suffix of ``context`` (n <= max_n) that occurs in the corpus."""
        lo, hi, best = 0, min(max_n, len(context), SORT_DEPTH), (0, 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self.find(context[-mid:])
            if found[1] > found[0]:
                lo, best = mid, found
            else:
                hi = mid - 1
        return lo, best

    def continuations(self, found: tuple[int, int], n: int, depth: int, limit: int) -> list[list[int]]:
        """The ``depth`` tokens after up to ``limit`` occurrences (cut at a document's end)."""
        starts = self.order[found[0]:min(found[1], found[0] + limit)] + n
        out = []
        for s in starts.tolist():
            cont = self.tokens[s:s + depth].tolist()
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            out.append(cont)
        return out


# --- candidates -----------------------------------------------------------------------------------------------------


@dataclass
class Candidates:
    """A trie of proposed continuations: node i has token[i], parent[i] (-1: a child of the root) and a score."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    def add(self, continuations: list[list[int]], weight: float) -> None:
        """Add continuations, each worth ``weight / len(continuations)``; a node keeps its larger score."""
        if not continuations:
            return
        counts: dict[int, float] = {}
        share = weight / len(continuations)
        for cont in continuations:
            parent = -1
            for token in cont:
                key = (parent, token)
                if key not in self.index:
                    self.index[key] = len(self.tokens)
                    self.tokens.append(token)
                    self.parents.append(parent)
                    self.scores.append(0.0)
                parent = self.index[key]
                counts[parent] = counts.get(parent, 0.0) + share
        for node, score in counts.items():
            self.scores[node] = max(self.scores[node], score)

    def depths(self) -> list[int]:
        """Each node's depth (1: a child of the root); parents come before their children in the node order."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def best_branch(self, limit: int, scores: Sequence[float] | None = None) -> list[int]:
        """One branch of up to ``limit`` nodes: from the root, the best-scored child at each level."""
        scores = self.scores if scores is None else scores
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        branch, parent = [], -1
        while len(branch) < limit and children.get(parent):
            parent = max(children[parent], key=lambda n: scores[n])
            branch.append(parent)
        return branch

    def ranked(self, limit: int, scores: Sequence[float] | None = None) -> list[int]:
        """Up to ``limit`` nodes, best first by ``scores`` (default: the raw scores), every node after its parent (a
        best-first walk from the root)."""
        scores = self.scores if scores is None else scores
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        heap = [(-scores[c], c) for c in children.get(-1, [])]
        heapq.heapify(heap)
        order: list[int] = []
        while heap and len(order) < limit:
            _, node = heapq.heappop(heap)
            order.append(node)
            for c in children.get(node, []):
                heapq.heappush(heap, (-scores[c], c))
        return order


@dataclass
class SuffixPlan:
    """One step's candidates (``cands``, from a match of length class ``bucket``) and the nodes chosen to verify,
    best first (each after its parent)."""

    bucket: int
    cands: Candidates
    chosen: list[int]
    depths: list[int]  # every candidate's depth (cands.depths()), for the calibration's update
    expected: float = 0.0  # drafted tokens the chosen nodes are expected to yield (their acceptance probabilities)
    first: float = 0.0  # the chance that one of the chosen first-level nodes is accepted (siblings exclude each other)


@dataclass(frozen=True)
class SuffixRanking:
    """One step's candidates from a match of length class ``bucket``, every candidate's depth and calibrated
    acceptance probability, and the ones worth a look, best first (each after its parent)."""

    bucket: int
    cands: Candidates
    depths: list[int]
    probs: list[float]
    ranked: list[int]


def candidates_draft(root: int, cands: Candidates, chosen: list[int], device: torch.device,
                     chain: Sequence[int] = ()) -> Draft:
    """The root, then ``chain`` (another drafter's tokens, one a level: a hybrid's spliced branch, decode/hybrid.py),
    then the ``chosen`` nodes (each after its parent) under the chain's last token, as a Draft."""
    m = len(chain)
    slot = {node: m + 1 + i for i, node in enumerate(chosen)}
    parents = [-1] + list(range(m)) + [m if cands.parents[n] < 0 else slot[cands.parents[n]] for n in chosen]
    tokens = torch.tensor([root, *chain] + [cands.tokens[n] for n in chosen], dtype=torch.long, device=device)
    return Draft(tokens=tokens, tree=Tree.from_parents(parents).to(device))


# --- the drafter ----------------------------------------------------------------------------------------------------


class SuffixDrafter(DrafterBase):
    """Proposes continuations of the longest earlier match (see the module docstring).

    ``budget``, ``max_nodes``, ``max_depth``, ``max_match``, ``remember``: the suffix family's settings
    (conf/suffix.yaml describes them and writes their defaults). ``budget``: ``auto`` (adaptive, up to
    ``max_nodes`` drafted nodes) or a fixed number of drafted nodes.
    ``cost_curve``: the verify cost curve to choose sizes with (default: measured for ``model`` and cached).
    ``chain``: draft one branch (the best child at each level) instead of a tree, for engines that verify chains
    (vLLM: serve/vllm_suffix.py).
    """

    def __init__(self, model: torch.nn.Module | None = None, corpus: SuffixArray | None = None, *, budget: int | str,
                 max_nodes: int, max_depth: int, max_match: int, remember: int, max_occurrences: int = 32,
                 cost_curve: CostCurve | None = None, chain: bool = False):
        if budget != "auto" and (not isinstance(budget, int) or budget < 0):
            raise DecodeSetupError(f"draft.budget={budget!r}: use auto or a number of drafted nodes >= 0.")
        if min(max_nodes, max_depth, max_match, max_occurrences) < 1:
            raise DecodeSetupError("draft.max_nodes, max_depth, max_match and max_occurrences must be >= 1.")
        if not isinstance(remember, int) or remember < 0:
            raise DecodeSetupError(f"draft.remember={remember!r}: give the number of tokens of earlier answers to "
                                   "index (0: none).")
        self.corpus, self.budget = corpus, budget
        self.remember = remember
        self.answers: list[list[int]] = []  # earlier answers, oldest first (at most ``remember`` tokens in all)
        self._kept = 0  # tokens in ``answers``
        self.history: SuffixArray | None = None  # the index over them
        self._indexed = 0  # tokens of ``answers`` in ``history``
        self._waiting = 0  # tokens of answers kept since it was built
        self._answer_from: int | None = None  # where the current answer starts in self.index.tokens
        self.max_nodes, self.max_depth, self.max_match = max_nodes, max_depth, max_match
        self.max_occurrences = max_occurrences
        self.chain = chain
        self.model, self.cost_curve = model, cost_curve
        self.calibration = Calibration()
        self.index = NgramIndex(max_match)
        self.device = torch.device("cpu")
        self._pending: SuffixPlan | None = None  # the plan of the draft being verified
        self.explore_every = 16  # budget=auto: after this many steps with candidates but none verified, verify one
        self._idle = 0

    @property
    def max_draft_depth(self) -> int:
        return int(self.max_depth)

    def curve(self) -> CostCurve:
        if self.cost_curve is None:
            kernel = "small_batch" if self.device.type == "cpu" else "torch"
            self.cost_curve = measured_cost_curve(self.model, kernel)
        return self.cost_curve

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.device = state.prompt_ids.device
        if self.remember and self._answer_from is not None:
            self.remember_answer(self.index.tokens[self._answer_from:])
        self.index = NgramIndex(self.max_match)
        self.index.extend(state.prompt_ids.tolist() + [state.next_token])
        self._answer_from = state.prompt_length
        self._pending = None

    def remember_answer(self, answer: Sequence[int]) -> None:
        """Keep a finished answer for later generations (the oldest dropped past ``remember`` tokens); the history
        index is rebuilt once what it lacks reaches an eighth of it."""
        if len(answer) < 2:
            return
        self.answers.append([int(t) for t in answer])
        self._waiting += len(answer)
        self._kept += len(answer)
        while self._kept > self.remember and self.answers:
            self._kept -= len(self.answers.pop(0))
        if self.answers and self._waiting >= max(1, self._indexed // 8):
            self.history = SuffixArray.build(self.answers)
            self._indexed, self._waiting = self._kept, 0

    def _candidates(self, depth: int, extra: Sequence[int] = ()) -> tuple[int, Candidates]:
        """The match class and candidates after the indexed tokens, followed by ``extra`` (not indexed) if given."""
        n_local, positions = self.index.longest_match(extra)
        context = self.index.tokens[-self.max_match:] + [int(t) for t in extra]  # the indexes match at most max_match
        cands = Candidates()
        cands.add(self.index.continuations(positions, depth, self.max_occurrences), 1.0)
        n = n_local
        for index in (self.corpus, self.history):
            if index is not None:
                n_index, found = index.longest_match(context, self.max_match)
                if n_index:
                    cands.add(index.continuations(found, n_index, depth, self.max_occurrences), 1.0)
                n = max(n, n_index)
        return min(n, 8), cands

    def plan(self, state: DecodeState, max_depth: int, base_nodes: int = 1,
             base_expected: float = 1.0) -> SuffixPlan:
        """This step's candidates and the nodes worth verifying, on top of ``base_nodes`` tree nodes already
        expected to yield ``base_expected`` tokens (the root alone: 1 and 1.0; a hybrid tree passes its other
        drafter's share, so the suffix's nodes pay for what they add to the cost of the whole tree)."""
        return self.choose(self.rank(state, max_depth), base_nodes, base_expected)

    def rank(self, state: DecodeState, max_depth: int) -> SuffixRanking:
        """This step's candidates, ranked, with their calibrated acceptance probabilities (the matching: the part
        of a plan that reads the indexes)."""
        self.index.extend(state.new_tokens[len(self.index.tokens) - state.prompt_length:])
        return self._ranking(max_depth)

    def rank_after(self, extra: Sequence[int], max_depth: int) -> SuffixRanking:
        """:meth:`rank` for the tokens so far followed by ``extra`` (another drafter's chain, not yet verified): the
        continuations that would follow it, with their calibrated acceptance probabilities given that ``extra`` is
        accepted. Reads the indexes as they stand (after this step's :meth:`rank`) and changes nothing."""
        return self._ranking(max_depth, extra)

    def _ranking(self, max_depth: int, extra: Sequence[int] = ()) -> SuffixRanking:
        bucket, cands = self._candidates(min(self.max_depth, max_depth), extra)
        limit = self.max_nodes if self.budget == "auto" else self.budget
        depths = cands.depths()
        rank = cands.best_branch if self.chain else cands.ranked
        probs = self.probabilities(cands, bucket, depths)
        ranked = rank(limit, probs) if self.budget == "auto" else rank(limit)
        return SuffixRanking(bucket, cands, depths, probs, ranked)

    def choose(self, ranking: SuffixRanking, base_nodes: int = 1, base_expected: float = 1.0,
               final: bool = True) -> SuffixPlan:
        """The plan from ``ranking``: with ``budget=auto`` the ranked candidates that pay on top of ``base_nodes``
        nodes expected to yield ``base_expected`` tokens (:func:`selfspec.decode.adaptive.best_size`); else all of them.
        ``final`` False: a what-if (a hybrid weighing its other drafter), which leaves the idle count alone."""
        ranked, probs = ranking.ranked, ranking.probs
        if self.budget == "auto":
            k = best_size([probs[n] for n in ranked], self.curve(), len(ranked), base_nodes, base_expected)
            if final:
                self._idle = self._idle + 1 if ranked and k == 0 else 0
                if self._idle > self.explore_every:  # a cheap look (the best candidate alone), so estimates that
                    k, self._idle = 1, 0  # fell too low can recover when the text turns predictable
        else:
            k = len(ranked)
        chosen = ranked[:k]
        first = min(1.0, sum(probs[n] for n in chosen if ranking.depths[n] == 1))
        return SuffixPlan(ranking.bucket, ranking.cands, chosen, ranking.depths,
                          expected=sum(probs[n] for n in chosen), first=first)

    def probabilities(self, cands: Candidates, bucket: int, depths: list[int]) -> list[float]:
        """Every candidate's calibrated acceptance probability (by its match class and ``depths``, as
        ``cands.depths()`` gives them), never above its parent's: a node is accepted only with its whole branch."""
        probs = self.calibration.probabilities(cands.scores, bucket, depths)
        for node, parent in enumerate(cands.parents):
            if parent >= 0:
                probs[node] = min(probs[node], probs[parent])
        return probs

    def record(self, plan: SuffixPlan, accepted: int, observed: int | None = None) -> None:
        """The plan's branch was accepted to depth ``accepted``: the calibration learns, per depth, that of the nodes
        chosen there the one on that branch was accepted (if the branch reached it) and the others were not.
        ``observed``: only the depths up to it were seen (a plan that was not verified, scored against the target's
        tokens where they end: serve/vllm_hybrid.py); default all."""
        if not plan.chosen:
            return
        by_depth: dict[int, list[float]] = {}
        for node in plan.chosen:
            by_depth.setdefault(plan.depths[node], []).append(plan.cands.scores[node])
        for depth, scores in sorted(by_depth.items()):
            if observed is not None and depth > observed:
                break
            self.calibration.update(plan.bucket, scores, int(accepted >= depth), depth)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        self._pending = self.plan(state, max_depth)
        return candidates_draft(state.next_token, self._pending.cands, sorted(self._pending.chosen), self.device)

    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        if self._pending is not None:
            self.record(self._pending, len(verdict.path) - 1)
        self._pending = None


# --- corpora ---------------------------------------------------------------------------------------------------------


def corpus_documents(path: Path) -> list[str]:
    """The texts a corpus file contributes: the assistant turns of a ShareGPT / OpenAI-messages json or jsonl (the
    default data, scripts/regenerate.py's output), the answers of decode/run.py's answers.jsonl, or a text file."""
    if path.suffix not in (".json", ".jsonl"):
        return [path.read_text(errors="replace")]
    from selfspec.core.records import parse_turns, read_records  # the tolerant reader the training data uses (cut-off files too)

    texts: list[str] = []
    for record in read_records(path):
        messages, _ = parse_turns(record)
        if messages:
            texts.extend(m["content"] for m in messages if m["role"] == "assistant")
        elif isinstance(record, dict) and isinstance(record.get("answers"), list):
            texts.extend(str(a) for a in record["answers"])
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            texts.append(record["text"])
    return texts


def load_corpus(path: str | Path, tokenizer, verbose: bool = True) -> SuffixArray:
    """A corpus file as a suffix array, built once and cached (keyed by the file's path, size, time and the
    tokenizer's vocabulary size and name)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DecodeSetupError(f"draft.corpus={path}: no such file. Give a json/jsonl of conversations or a text file.")
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, len(tokenizer),
                      getattr(tokenizer, "name_or_path", "")])
    cached = cache_dir() / "suffix" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if cached.is_file():
        return SuffixArray.load(cached)

    texts = corpus_documents(path)
    documents = [tokenizer(t, add_special_tokens=False)["input_ids"]
                 for t in tqdm(texts, desc="corpus", unit="doc", disable=not verbose)]
    index = SuffixArray.build(documents)
    cached.parent.mkdir(parents=True, exist_ok=True)
    index.save(cached)
    if verbose:
        print(f"[selfspec] suffix index of {path.name}: {len(documents):,} texts, {len(index.tokens):,} tokens")
    return index


# --- what decode/families.py registers for the suffix family ---------------------------------------------------------


def suffix_from_settings(heads, target, settings: dict) -> SuffixDrafter:
    corpus = load_corpus(settings["corpus"], target.tokenizer) if settings.get("corpus") else None
    budget = int(settings["budget"]) if str(settings["budget"]).isdigit() else settings["budget"]  # checked there
    return SuffixDrafter(target.model, corpus=corpus, budget=budget, max_nodes=int(settings["max_nodes"]),
                         max_depth=int(settings["max_depth"]), max_match=int(settings["max_match"]),
                         remember=int(settings["remember"]))
