"""Outcome rewards: math answers by `reward.verifier`, arithmetic answers exactly.

Verifiers (`VERIFIERS`, each paper's checker; the string rules are in `rewards.answer_rules`):
math_verify (the default and the lenient one: math-verify with the boxed answer first),
prof_math_verify (PROF-GRPO's call of math-verify: its default extraction priorities,
expressions before LaTeX, 20 s per sample), hendrycks_math (PURE: last boxed answer, MATH
string normalisation, no symbolic check), prime_math (PRIME: the released grader's stages,
`rewards.prime_grader`, 300 s per sample), verl_prime_math (PAPO: verl's copy of that grader,
whose last sympy stage never runs and whose pmatrix rules do).

math-verify bounds its own work with `signal.alarm`, which (a) only works on the main thread
(it raises elsewhere, e.g. in a rollout thread), (b) takes whole seconds, and (c) cannot stop
long C-level work (a big-integer power inside sympy). So every math check here runs in a
worker process that is killed (SIGKILL) at the per-sample deadline and restarted lazily; a
timeout, a parse failure or a worker crash scores 0.0 ("incorrect"). Inside the worker
math-verify's own alarms stay on as a cheaper first line, so most slow inputs end without a
restart.

Latency (measured on the shared 2-core CPU dev box): the first call starts the worker (a fresh
Python that imports math-verify and sympy: 0.5-1.4 s, not charged to the per-sample limit);
afterwards a check takes 3-15 ms (MATH500 gold answers: ~8 ms each on an idle box). A restart
after a hard kill costs the start again, on the next call.

Ground truths are parsed as `\\boxed{<gt>}` (MATH500, AIME24, AMC23, Minerva and OlympiadBench
gold answers all verify against themselves that way); responses are parsed with boxed answers
first, then LaTeX, then plain expressions.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from megaprm.rewards.answer_rules import hendrycks_math_equal
from megaprm.tasks.arithmetic import Problem, check_steps, extract_boxed_int

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 5.0
_STARTUP_TIMEOUT_S = 120.0  # worker start (imports); not charged to any sample
# the folder holding the megaprm package, so the worker imports this same copy
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inner_timeout(timeout_s: float) -> int | None:
    """math-verify's own alarm (whole seconds) per parse/compare: half the budget, so the
    worker usually survives a slow input; below 2 s only the hard kill applies."""
    return int(timeout_s // 2) if timeout_s >= 2 else None


def _worker_main(fd: int) -> None:
    """Worker loop on socket `fd`: receive (checker, response, ground_truth, inner_timeout), send
    back 0.0 / 1.0. Started as `python -c` (not multiprocessing's spawn), so the parent's
    __main__ is never re-imported and scripts need no `if __name__ == "__main__"` guard."""
    import logging

    conn = Connection(fd)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.metric import math_metric

    # deferred: sympy and pylatexenc load in the worker process only
    from megaprm.rewards.prime_grader import prime_grade

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # per-sample timeout chatter
    pred_cfg = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    # PROF-GRPO's call (verl/utils/reward_score/math_verify.py compute_score): math-verify's
    # default extraction priorities, expressions tried before LaTeX, its own 5 s alarms
    prof_metric = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                              pred_extraction_target=(ExprExtractionConfig(),
                                                      LatexExtractionConfig()))

    def lenient(response, ground_truth, inner):
        gold = parse("\\boxed{" + ground_truth + "}", gold_cfg, parsing_timeout=inner)
        pred = parse(response, pred_cfg, parsing_timeout=inner)
        return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=inner)

    checkers = {
        "math_verify": lenient,
        "prof_math_verify": lambda r, g, _: prof_metric(["\\boxed{" + g + "}"], [r])[0] == 1.0,
        "prime_math": lambda r, g, _: prime_grade(r, g),
        "verl_prime_math": lambda r, g, _: prime_grade(r, g, verl=True),
    }
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        checker, response, ground_truth, inner = job
        try:
            ok = checkers[checker](response, ground_truth, inner)
        except BaseException:  # noqa: BLE001 - any failure of the checker means "not verified"
            ok = False
        conn.send(1.0 if ok else 0.0)


class _Worker:
    """One worker process and a socket to it."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        code = "import sys; from megaprm.rewards.verifiers import _worker_main; _worker_main(int(sys.argv[1]))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if not self.conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"math-verify worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            assert self.conn.recv() == "ready"
        except EOFError as exc:
            self.kill()
            raise RuntimeError("math-verify worker exited at start (see its stderr above)") from exc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class MathVerifier:
    """A pool of `num_workers` killable math-verify worker processes (started on first use)."""

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"MathVerifier: num_workers={num_workers} must be >= 1")
        self.num_workers = num_workers
        self._workers: list[_Worker | None] = []  # None: start on next use
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _pool(self) -> list[_Worker | None]:
        if self._pid != os.getpid():  # we were forked: the sockets belong to the parent
            self._workers, self._pid = [], os.getpid()
        self._workers += [None] * (self.num_workers - len(self._workers))
        return self._workers

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        inner_timeout: int | None | str = "auto",
        checker: str = "math_verify",
    ) -> list[float]:
        """1.0 where the response's answer is equivalent to the ground truth under `checker`
        (math_verify, prof_math_verify or prime_math: the worker's checkers), else 0.0; each
        sample gets at most `timeout_s` seconds of wall time in a worker."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        inner = _inner_timeout(timeout_s) if inner_timeout == "auto" else inner_timeout
        with self._lock:
            return self._run(list(responses), [str(g) for g in ground_truths], timeout_s, inner,
                             checker)

    def _run(self, responses, truths, timeout_s, inner, checker) -> list[float]:
        scores = [0.0] * len(responses)
        pending = list(range(len(responses)))[::-1]  # pop() from the end = in order
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (sample, deadline)
        pool = self._pool()
        while pending or busy:
            for slot in range(len(pool)):
                if slot not in busy and pending:
                    if pool[slot] is None:
                        pool[slot] = _Worker()  # start time is not charged to the sample
                    i = pending.pop()
                    pool[slot].conn.send((checker, responses[i], truths[i], inner))
                    busy[slot] = (i, time.monotonic() + timeout_s)
            next_deadline = min(d for _, d in busy.values())
            ready = wait([pool[s].conn for s in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            for slot, (i, deadline) in list(busy.items()):
                conn = pool[slot].conn
                if conn in ready:
                    try:
                        scores[i] = float(conn.recv())
                    except (EOFError, OSError):  # the worker died on this input: score 0
                        pool[slot].kill()
                        pool[slot] = None
                    del busy[slot]
                elif now >= deadline:  # hard timeout: kill, score 0, restart on next use
                    pool[slot].kill()
                    pool[slot] = None
                    del busy[slot]
        return scores

    def close(self) -> None:
        for w in self._workers:
            if w is not None:
                w.kill()
        self._workers = []


_DEFAULT = MathVerifier()


def math_verify_reward(response: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the (boxed, else last parsable) answer in `response` equals `ground_truth` up to
    LaTeX / numeric / symbolic equivalence, else 0.0. Never raises on bad input, never runs
    longer than `timeout_s` per sample (after the one-time worker start)."""
    return _DEFAULT.score([response], [ground_truth], timeout_s)[0]


def arithmetic_reward(problem: Problem, response: str) -> float:
    """Exact: 1.0 iff the last `\\boxed{}` of the response holds the problem's answer."""
    return 1.0 if check_steps(problem, response).final_correct else 0.0


def _arithmetic_truth_reward(response: str, truth: Problem | str | int) -> float:
    if isinstance(truth, Problem):
        return arithmetic_reward(truth, response)
    try:
        expected = int(str(truth).strip())
    except ValueError:
        return 0.0
    return 1.0 if extract_boxed_int(response) == expected else 0.0


VERIFIERS = ("math_verify", "prof_math_verify", "hendrycks_math", "prime_math", "verl_prime_math")
# each verifier's per-sample limit where its release sets one: PRIME's process pool waits 300 s
# (reward_score/prime.py), PROF's 20 s (reward_score/math_verify.py parallel_compute_score)
TIMEOUT_S = {"prime_math": 300.0, "verl_prime_math": 300.0, "prof_math_verify": 20.0,
             "math_verify": DEFAULT_TIMEOUT_S}


def math_scores(responses: Sequence[str], truths: Sequence[str], verifier: str = "math_verify",
                timeout_s: float | None = None) -> list[float]:
    """1.0 / 0.0 per response under `verifier` (module docstring); `timeout_s` per sample,
    default the verifier's own (TIMEOUT_S)."""
    if verifier == "hendrycks_math":
        return [float(hendrycks_math_equal(r, t)) for r, t in zip(responses, truths)]
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r}; valid verifiers are {VERIFIERS}")
    return _DEFAULT.score(responses, truths, timeout_s or TIMEOUT_S[verifier], checker=verifier)


def score_outcomes(
    responses: Sequence[str],
    ground_truths: Sequence[str | Problem | int],
    kind: str = "math",
    timeout_s: float | None = None,
    verifier: str = "math_verify",
) -> torch.Tensor:
    """Outcome rewards r_out in {0, 1}, float32 [B]. kind "math": `verifier` (ground truths are
    answer strings); kind "arithmetic": exact (ground truths are `Problem`s or integer
    answers)."""
    import torch  # here, not at module level: the verifier worker process imports this module

    if len(responses) != len(ground_truths):
        raise ValueError(f"score_outcomes: {len(responses)} responses but {len(ground_truths)} ground truths")
    if kind == "math":
        scores = math_scores(list(responses), [str(g) for g in ground_truths], verifier,
                             timeout_s)
    elif kind == "arithmetic":
        scores = [_arithmetic_truth_reward(r, g) for r, g in zip(responses, ground_truths)]
    else:
        raise ValueError(f"score_outcomes: kind={kind!r}; valid kinds are 'math', 'arithmetic'")
    return torch.tensor(scores, dtype=torch.float32)
