"""tune: from a diagnosis to a verified change, on an engine that tune starts and stops itself.

The loop: serve the profile, warm up and bench the baseline; read the diagnosis of that run (the
bench result carries engine_metrics' report of the run's /metrics window and timeline); turn the
plan's first lever tune may try into one profile change (levers.py); restart the engine with it,
bench the same workload with the same seed, compare the two runs and keep or revert the change
(trials.py); again until the SLO holds, no lever is left or the budget is spent. What is improved
is the figure the SLO misses, not the diagnosis's first finding: where the diagnosis names nothing
tune can try for it, or its change did not move it, the settings that figure depends on are
searched (levers.figure_change). A setting with a range is searched (bracket and bisect, toward the
target) before the next lever. Each run is written when it ends,
so Ctrl-C or a crashed engine keeps every finished trial; every engine tune started is stopped
before `tune` returns. Against a server it did not start, `measure` benches once and proposes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from rooflib.core import cli, fileio, printing, signals
from rooflib.core.errors import ServerError, UsageError
from rooflib.doctor import window
from rooflib.load import asyncclient, bench_options, benchrun, comparison
from rooflib.server import deployment, engine_metrics
from rooflib.server.deployment import Served
from rooflib.serving import levers, profiles, trials

SCHEMA_VERSION = 1
STOP_GRACE_S = 60.0  # an engine shuts down in seconds; past this it is killed
TEMPLATE = Path(__file__).resolve().parents[1] / "render" / "templates" / "tune_log_entry.md.j2"
BASELINE = "baseline"
# A run whose client stalled is measured again on the same engine, at most this many more times:
# on a machine whose other work starves the client, a later try often finds it quieter.
RERUNS = 2
SAMPLED_ENOUGH = 5  # gauge samples of a --like window from which their mean is the requests in flight


@dataclass(frozen=True)
class Budget:
    runs: int | None
    minutes: float | None

    def spent(self, runs: int, elapsed_s: float, trial_s: float) -> str | None:
        """Why no further trial fits (None while one does): `trial_s` is what one costs, an
        engine start and a run."""
        if self.runs is not None and runs >= self.runs:
            return f"the budget of {self.runs} bench runs is spent"
        if self.minutes is not None and elapsed_s + trial_s > self.minutes * 60:
            return (f"another trial (about {trial_s:.0f} s: an engine start and a run) would pass the budget of "
                    f"{self.minutes:g} minutes ({elapsed_s / 60:.1f} spent)")
        return None

    def eta_s(self, runs: int, elapsed_s: float, trial_s: float) -> float | None:
        """Seconds until the budget is spent at `trial_s` a trial (None: no budget bounds it)."""
        left = []
        if self.runs is not None:
            left.append(max(0, self.runs - runs) * trial_s)
        if self.minutes is not None:
            left.append(max(0.0, self.minutes * 60 - elapsed_s))
        return min(left) if left else None


@dataclass(frozen=True)
class Setup:
    """Everything one tune needs, checked before the first engine starts."""
    profile: Mapping[str, Any]   # the start profile, --set overrides applied, validated
    source: str                  # the profile's name or path, as given
    port: int
    bench: bench_options.BenchOptions  # the workload and the SLO (bench.slo), every run's
    budget: Budget
    out: Path
    sizing: levers.Sizing | None
    startup_timeout_s: float
    give: str = "queue"          # what the user gives when token speed and queue wait conflict: queue or speed


# ---------------------------------------------------------------------------------------------
# The engine

@dataclass(frozen=True)
class Engine:
    proc: subprocess.Popen
    url: str
    log: Path
    start_s: float


def client_host(host: str) -> str:
    """Where a client on this machine reaches an engine bound to `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def engine_env(profile: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """The extra environment of an engine tune starts: the profile's `env`, and for a vLLM that
    listens on this machine only, VLLM_SERVER_DEV_MODE=1 (unless the profile sets it): its
    /server_info then says the settings the profile leaves to vLLM's defaults (the running cap, the
    per-step token budget), which no metric exports. Dev mode's other routes would reach beyond
    this machine where the engine listens beyond it, so there it stays off."""
    if profile["engine"] == "vllm" and profile.get("host", "127.0.0.1") in LOOPBACK:
        return {"VLLM_SERVER_DEV_MODE": "1", **env}
    return dict(env)


def start_engine(profile: Mapping[str, Any], port: int, log: Path, timeout_s: float) -> Engine:
    """Start the engine of `profile` in its own process group and wait until /health answers;
    UsageError for a port in use or no engine Python, ServerError when it does not start."""
    argv, env = profiles.render(dict(profile), port)
    env = engine_env(profile, env)
    host = profile.get("host", "127.0.0.1")
    profiles.check_port_free(host, port)
    began = time.monotonic()
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except FileNotFoundError:
            raise UsageError(f"engine Python {argv[0]!r} not found: install {profile['engine']} or set "
                             "ROOFLINE_ENGINE_PYTHON (for the CPU test engines: task setup-cpu-vllm, setup-cpu-sglang)")
    url = f"http://{client_host(host)}:{port}"
    engine = Engine(proc, url, log, 0.0)
    try:
        profiles.wait_healthy(url, proc, timeout_s, log)
    except BaseException:
        stop_engine(engine)
        raise
    return Engine(proc, url, log, time.monotonic() - began)


def stop_engine(engine: Engine) -> bool:
    """Stop the engine as Ctrl-C would (then kill what is left of its process group, a crashed
    engine's workers too); Ctrl-C and SIGTERM wait meanwhile. True when one came."""
    with signals.SignalHold("tune") as hold:
        hold.start()
        profiles.stop(engine.proc, grace_s=STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.proc.pid, signal.SIGKILL)
        return bool(hold.noted)


def exited(engine: Engine, within_s: float = 5.0) -> bool:
    """Whether the engine has exited: a process being killed resets its connections before it is
    gone, so a client can see the failure first; it is given a moment."""
    try:
        engine.proc.wait(within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def serving(engine: Engine, within_s: float = 5.0) -> bool:
    """Whether the engine still serves after requests failed: vLLM's /health answers 503 once its
    engine core died, and the API server may take a while to exit after that."""
    return not exited(engine, within_s) and profiles.answers_health(engine.url, timeout_s=10)


# ---------------------------------------------------------------------------------------------
# One run

def bench_once(url: str, api_key: str | None, options: bench_options.BenchOptions, path: Path,
               served: Served | None = None) -> dict[str, Any]:
    """One bench run against `url`, written to `path` (bench.py --json's document, for compare
    and report) before it is returned; its diagnosis told the settings in `served`. Ctrl-C
    during the load ends it early: the result says interrupted."""
    target = asyncclient.find_target(asyncclient.Target(url, api_key), None, options.timeout_s)
    with signals.SignalHold("tune") as hold:
        result = benchrun.execute(target, options, hold, quiet=True, served=served)
        result.pop("records")
        fileio.write_atomic(path, printing.json_text(result))
    return result


def warm_up(url: str, api_key: str | None, options: bench_options.BenchOptions) -> None:
    """A fresh engine's first requests pay for its one-time set-up (the CPU build's first
    forward pass takes seconds): a short unmeasured run of the workload at its concurrency first,
    so that neither the measured run nor the /metrics window the diagnosis reads holds it."""
    quick = dataclasses.replace(options, num_requests=max(1, options.concurrency or options.warmup or 1),
                                num_requests_given=True, warmup=0, duration_s=None, timeline_interval_s=0,
                                prometheus=None)
    target = asyncclient.find_target(asyncclient.Target(url, api_key), None, options.timeout_s)
    with signals.SignalHold("tune") as hold:
        interrupted = benchrun.execute(target, quick, hold, quiet=True)["interrupted"]
    if interrupted:
        raise KeyboardInterrupt


def diagnosis_of(run: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return ((run.get("server") or {}).get("metrics") or {}).get("diagnosis")


def compared(before: Mapping[str, Any], after: Mapping[str, Any], files: tuple[str, str]) -> dict[str, Any]:
    return comparison.compare(dict(before), dict(after), files, files)


# ---------------------------------------------------------------------------------------------
# The loop

def clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """One line per phase on stderr: runs against the budget, time spent, the ETA."""

    def __init__(self, budget: Budget, say: Callable[[str], None]):
        self.budget, self.say, self.began = budget, say, time.monotonic()
        self.runs, self.start_s, self.bench_s = 0, 0.0, []

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def trial_s(self) -> float:
        """What one more trial costs: the first engine start's time and a mean run."""
        return self.start_s + (sum(self.bench_s) / len(self.bench_s) if self.bench_s else 0.0)

    def __call__(self, message: str) -> None:
        runs = f"{self.runs}/{self.budget.runs}" if self.budget.runs is not None else f"{self.runs}"
        eta = self.budget.eta_s(self.runs, self.elapsed(), self.trial_s()) if self.bench_s else None
        self.say(f"tune [runs {runs}, {clock(self.elapsed())}" + (f", ETA {clock(eta)}" if eta is not None else "")
                 + f"]: {message}")


def trial_row(n: int, change: levers.Change | None, decision: str, why: str, **facts: Any) -> dict[str, Any]:
    """One row of the trials table: the change, what was decided and why, the run's figures and
    files (`facts` fills what is known)."""
    return {"n": n, "setting": change.key if change else None, "flag": change.flag if change else None,
            "from": change.current if change else None, "to": change.proposed if change else None,
            "decision": decision, "why": why, "run": None, "figures": {}, "engine_start_s": None, "bench_s": None,
            "engine_log": None, "vram": None, "note": None, "figure": None, "rejected": None, "throughput": None,
            **facts}


@dataclass(frozen=True)
class Measured:
    """The configuration every trial is judged against: its profile, its run and that run's file."""
    profile: Mapping[str, Any]
    run: Mapping[str, Any]
    file: str


class Runner:
    """The engine tune runs now (one at a time), its runs, and the progress line."""

    def __init__(self, setup: Setup, say: Callable[[str], None]):
        self.setup, self.show = setup, Progress(setup.budget, say)
        self.api_key = profile_api_key(setup.profile)
        self.engine: Engine | None = None
        self.offered_tok_s: float | None = None  # the baseline's output tokens a second: the load offered

    def start(self, profile: Mapping[str, Any], name: str, n: int) -> Engine:
        """Start the engine and warm it up; its start_s counts both."""
        self.show(f"{name}: starting the engine")
        began = time.monotonic()
        engine = start_engine(profile, self.setup.port, self.setup.out / f"engine-{n}.log",
                              self.setup.startup_timeout_s)
        self.engine = engine
        self.show(f"{name}: engine up in {engine.start_s:.0f} s; warming it up")
        warm_up(engine.url, self.api_key, self.setup.bench)
        self.engine = dataclasses.replace(engine, start_s=time.monotonic() - began)
        self.show.start_s = self.show.start_s or self.engine.start_s  # the first start prices each restart
        return self.engine

    def bench(self, name: str, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Bench the engine started from `profile`; the diagnosis is told the profile's settings.
        A run whose client stalled (bench's INVALID: its requests were timed late) measured the
        machine, not the engine: it is run again on the same engine, RERUNS times at most, and the
        run whose client stalled least is the one judged (`name`.json; the other tries
        beside it, `name`.try-N.json). The reruns are one run of the budget: they measure the same
        configuration."""
        options = self.setup.bench
        self.show(f"{name}: engine up and warm in {self.engine.start_s:.0f} s; bench ({options.num_requests} "
                  f"requests, {options.warmup} warm-up)")
        began = time.monotonic()
        self.show.runs += 1  # a run the engine crashed in counts against the budget too
        exported = deployment.server_settings(self.engine.url, profile["engine"], self.api_key, options.timeout_s)
        served = levers.served_with(profile, self.engine.url, self.setup.source, exported)
        path = self.setup.out / f"{name}.json"
        tries = [bench_once(self.engine.url, self.api_key, options, path, served)]
        while len(tries) <= RERUNS and trials.worth_rerunning(tries[-1]):
            self.show(f"{name}: {trials.client_stalled(tries[-1])}; measuring again on the same engine")
            tries.append(bench_once(self.engine.url, self.api_key, options,
                                    self.setup.out / f"{name}.try-{len(tries) + 1}.json", served))
        result = tries[-1] if tries[-1]["interrupted"] else trials.least_stalled(tries)
        if result is not tries[0]:
            fileio.write_atomic(self.setup.out / f"{name}.try-1.json", printing.json_text(tries[0]))
            fileio.write_atomic(path, printing.json_text(result))
        self.show.bench_s.append(time.monotonic() - began)
        return result

    def stop(self) -> None:
        """Stop the engine; a Ctrl-C that came meanwhile is obeyed now."""
        if self.engine is not None:
            came, self.engine = stop_engine(self.engine), None
            if came:
                raise KeyboardInterrupt

    def close(self) -> None:
        if self.engine is not None:
            stop_engine(self.engine)
            self.engine = None

    def baseline(self) -> Measured:
        engine = self.start(self.setup.profile, BASELINE, 0)
        run = self.bench(BASELINE, self.setup.profile)
        if engine.proc.poll() is not None:
            raise ServerError(f"the engine exited with status {engine.proc.returncode} during the baseline run: "
                              f"{profiles.why_it_stopped(engine.log)} (log {engine.log})")
        self.offered_tok_s = (run.get("throughput") or {}).get("output_tok_s")
        return Measured(self.setup.profile, run, f"{BASELINE}.json")

    def trial(self, n: int, change: levers.Change, best: Measured, target: str) -> tuple[dict[str, Any], Measured]:
        """One change tried against `best`: its row, and what the next trial is judged against."""
        name = f"trial-{n}"
        candidate = change.applied(best.profile)
        check = levers.start_check(candidate, self.setup.sizing)
        if check.fits is False and not check.marginal:
            self.show(f"{name}: {change.describe()} not run: the vram model says it will not start")
            return trial_row(n, change, trials.NOT_RUN, f"the vram model says it will not start: {check.text}",
                             vram=check.text), best
        anyway = (f"the vram model says it will not start, but its verdict is marginal ({check.text}): tried, "
                  "as a failed start costs one restart") if check.fits is False else None
        if anyway:
            self.show(f"{name}: {anyway}")
        facts: dict[str, Any] = {"vram": check.text, "note": anyway, "engine_log": f"engine-{n}.log"}
        self.stop()
        try:
            engine = self.start(candidate, name, n)
            facts["engine_start_s"] = engine.start_s
            result = self.bench(name, candidate)
        except KeyboardInterrupt:
            return trial_row(n, change, trials.INTERRUPTED, "interrupted: not judged", **facts), best
        except (ServerError, UsageError) as exc:  # it did not start, died, or the workload no longer fits it
            decision = trials.NO_START if self.engine is None else \
                trials.CRASHED if exited(self.engine) else trials.RUN_FAILED
            self.show(f"{name}: {change.describe()}: {decision}")
            self.stop()
            return trial_row(n, change, decision, str(exc), **facts), best
        facts.update(run=f"{name}.json", bench_s=self.show.bench_s[-1], figures=trials.figures(None, result),
                     rejected=trials.rejected(result), figure=target)
        if result["interrupted"]:
            return trial_row(n, change, trials.INTERRUPTED, "interrupted during the run: not judged", **facts), best
        if engine.proc.poll() is not None or (result["requests"]["failed"] and not serving(engine)):
            self.show(f"{name}: {change.describe()}: the engine crashed")
            self.stop()
            how = "stopped serving" if engine.proc.returncode is None else f"exited with status {engine.proc.returncode}"
            return trial_row(n, change, trials.CRASHED, f"the engine {how} during the run: "
                                                        f"{profiles.why_it_stopped(engine.log)}", **facts), best
        verdict = self.judged(facts, best, result, name, target)
        self.show(f"{name}: {change.describe()}: {verdict.decision}: {verdict.why}")
        row = trial_row(n, change, verdict.decision, verdict.why, **facts)
        return row, Measured(candidate, result, f"{name}.json") if verdict.decision == trials.KEPT else best

    def judged(self, facts: dict[str, Any], best: Measured, result: dict[str, Any], name: str,
               target: str) -> trials.Verdict:
        """The trial's verdict on `target`, weighed against the load offered; its figures and its
        throughput go into `facts` (the row being made)."""
        doc = compared(best.run, result, (best.file, f"{name}.json"))
        load = trials.throughput(self.offered_tok_s, result)
        facts["figures"] = trials.figures(doc, result)
        facts["throughput"] = None if load is None else {
            "made_tok_s": load.made_tok_s, "offered_tok_s": load.offered_tok_s, "keeps_up": load.keeps_up,
            "replicas": load.replicas}
        verdict = trials.weighed(trials.judge(doc, best.run, result, target), load, self.setup.give)
        stalled = trials.stalled_words(best.run, result)
        return dataclasses.replace(verdict, why=f"{verdict.why}; {stalled}") if stalled else verdict


class Search:
    """Which change to try next, and for which figure: the next value of the setting being searched
    (trials.next_value, toward the figure's target) while that figure misses; else, for each figure
    the SLO misses, furthest over its target first, the diagnosis's first lever that does not make
    that figure worse (levers.first_change), then the settings the figure depends on
    (levers.figure_change); once a lever of the diagnosis brought no kept value for a figure, or
    where the diagnosis is unsure of its root cause, the figure's own settings come first. The
    levers passed over on the way, each said once."""

    def __init__(self) -> None:
        self.lever: levers.Change | None = None  # its value before the search, and the first value
        self.figure = ""                          # the figure the lever's search moves
        self.aim: trials.Aim | None = None
        self.from_diagnosis = False
        self.tried: list[trials.Tried] = []
        self.done: list[str] = []
        self.doubted: list[str] = []              # figures a lever of the diagnosis did not move
        self.passed_over: list[str] = []

    def next_change(self, best: Measured) -> levers.Change | None:
        while True:
            lever = self.lever
            value = None
            if lever is not None and self.figure in trials.missed(best.run):
                start = lever.current if lever.current is not None else self.aim and self.aim.value
                value = trials.next_value(lever.key, start, lever.proposed, self.tried, self.aim)
            if value is not None and value != best.profile.get(lever.key):
                return levers.Change(lever.key, lever.flag, best.profile.get(lever.key, lever.current), value,
                                     lever.reason)
            if lever is not None:
                self.finish()
            if not self.choose(best):
                return None

    def finish(self) -> None:
        if self.from_diagnosis and not any(t.decision == trials.KEPT for t in self.tried):
            self.doubted.append(self.figure)
        self.done.append(self.lever.key)
        self.lever = None

    def choose(self, best: Measured) -> bool:
        """Start the search of the next lever (False: none is left for any missed figure)."""
        unsure = str(((diagnosis_of(best.run) or {}).get("root_cause") or {}).get("confidence", "")).startswith("low")
        for figure in trials.by_distance(best.run):
            ways = [(self.from_plan, True), (self.from_figure, False)]
            for way, from_diagnosis in reversed(ways) if unsure or figure in self.doubted else ways:
                choice = way(best, figure)
                self.passed_over += [line for line in choice.passed_over if line not in self.passed_over]
                if choice.change is not None:
                    self.begin(choice.change, figure, from_diagnosis, best)
                    return True
        return False

    def from_plan(self, best: Measured, figure: str) -> levers.Choice:
        return levers.first_change(diagnosis_of(best.run), best.profile, self.done, figure)

    def from_figure(self, best: Measured, figure: str) -> levers.Choice:
        return levers.figure_change(figure, best.run, best.profile, self.done)

    def begin(self, change: levers.Change, figure: str, from_diagnosis: bool, best: Measured) -> None:
        self.lever, self.figure, self.from_diagnosis, self.tried = change, figure, from_diagnosis, []
        self.aim = trials.Aim(trials.target_of(best.run, figure),
                              levers.in_effect(change.key, change.current, best.run, best.profile),
                              trials.measured(best.run, figure))

    def record(self, change: levers.Change, decision: str, figure: float | None = None) -> None:
        self.tried.append(trials.Tried(change.proposed, decision, figure))


def tune(setup: Setup, say: Callable[[str], None] = printing.progress) -> dict[str, Any]:
    """Run the loop; the tune document (see scripts/tune.py). A profile that does not start or an
    engine that dies during the baseline is a ServerError; Ctrl-C ends the loop with what is done."""
    runner, search = Runner(setup, say), Search()
    rows: list[dict[str, Any]] = []
    best: Measured | None = None
    stopped = ("", "")
    try:
        best = runner.baseline()
        rows.append(trial_row(0, None, BASELINE, baseline_words(best.run), run=best.file,
                              figures=trials.figures(None, best.run), engine_start_s=runner.show.start_s,
                              bench_s=runner.show.bench_s[-1], engine_log="engine-0.log",
                              rejected=trials.rejected(best.run)))
        if best.run["interrupted"]:
            raise KeyboardInterrupt
        while True:
            target = trials.worst(best.run)
            if target is None:
                kept = any(r["decision"] == trials.KEPT for r in rows)
                stopped = ("slo_met", "the SLO holds" + ("" if kept else " already: nothing to change"))
                break
            change = search.next_change(best)
            if change is None:
                stopped = ("no_lever", no_lever_words(target, search.done))
                break
            spent = setup.budget.spent(runner.show.runs, runner.show.elapsed(), runner.show.trial_s())
            if spent:
                stopped = ("budget", f"{spent}; the next change would have been {change.describe()}")
                break
            row, best = runner.trial(len(rows), change, best, search.figure)
            rows.append(row)
            if row["decision"] == trials.INTERRUPTED:
                raise KeyboardInterrupt
            search.record(change, row["decision"], row_figure(row, search.figure))
    except KeyboardInterrupt:
        stopped = ("interrupted", "interrupted: the trials done are kept")
    finally:
        runner.close()
    return document(setup, rows, best, stopped, search, runner)


def row_figure(row: Mapping[str, Any], figure: str) -> float | None:
    """The figure a trial's search moves, as its run measured it (None: no run was made)."""
    if figure == levers.REJECTED:
        return row["rejected"]
    return (row["figures"].get(figure) or {}).get("measured")


def profile_api_key(profile: Mapping[str, Any]) -> str | None:
    """The key the engine asks clients for: the profile's last --api-key in extra_args."""
    keys = [str(arg) for arg in profile.get("extra_args") or []]
    found = cli.flag_values(keys, profiles.API_KEY_FLAG)
    return found[-1] if found else None


def baseline_words(run: Mapping[str, Any]) -> str:
    """Whether the baseline meets the SLO, and what its client's stalls did to the figures."""
    stalled = trials.client_stalled(run)
    return baseline_slo_words(run) + (f"; {stalled}: a busy machine's stalls are in these figures (a stalled "
                                      "client reads tokens in bursts, late)" if stalled else "")


def baseline_slo_words(run: Mapping[str, Any]) -> str:
    missing = trials.missed(run)
    if not missing:
        return "the SLO holds"
    return "misses " + "; ".join(
        f"{trials.rejected(run)} of {run['requests']['sent']} requests rejected as longer than the context limit"
        if n == levers.REJECTED else
        f"{trials.FIGURES[n][2]} {printing.fmt_number(run['slo'][n]['measured'], 1)} ms > "
        f"{run['slo'][n]['target']:g} ms" for n in missing)


def no_lever_words(target: str, searched: Sequence[str]) -> str:
    tried = f"searched: {', '.join(searched)}" if searched else "no setting it depends on can be changed here"
    return (f"no lever left that tune can try, and {levers.FIGURE_WORDS[target]} still misses its target ({tried}); "
            "what no setting of this profile fixes needs the proposals below (hardware, precision, the client)")


def beside(run: Mapping[str, Any] | None, engine: str) -> list[str]:
    """The diagnosis's root cause where no setting tune tries acts on it (time outside the engine,
    a few streams in one read, the hardware): said beside the result, never its end."""
    root = (diagnosis_of(run or {}) or {}).get("root_cause")
    if root is None or levers.TUNABLE[engine].get(root.get("setting") or ""):
        return []
    return [f"{root['kind']}: {root['evidence']}"]


def trade_off_words(start: Mapping[str, Any], best: Measured | None, offered_tok_s: float | None) -> str | None:
    """What the kept changes cost the load, when one server no longer keeps up with it: the SLO
    figures at the kept settings, and the tokens it makes against those offered."""
    load = trials.throughput(offered_tok_s, best.run) if best is not None else None
    if load is None or load.keeps_up:
        return None
    settings = ", ".join(f"{key} {levers.shown(key, value)}" for key, value in best.profile.items()
                         if start.get(key) != value)
    figures = "; ".join(f"{trials.FIGURES[n][2]} {'meets' if c['met'] else 'misses'} {c['target']:g} ms "
                        f"({printing.fmt_number(c['measured'], 1)} ms)" for n, c in best.run["slo"].items())
    return f"{figures} at {settings or 'the start profile'}, but {load.said()}"


def document(setup: Setup, rows: list[dict[str, Any]], best: Measured | None, stopped: tuple[str, str],
             search: Search, runner: Runner) -> dict[str, Any]:
    start, winner, run = dict(setup.profile), dict(best.profile if best else setup.profile), best.run if best else None
    show = runner.show
    changes = [{"setting": key, "from": start.get(key), "to": winner[key]}
               for key in winner if start.get(key) != winner[key]]
    return {
        "kind": "tune", "schema_version": SCHEMA_VERSION, "mode": "tune",
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile": {"source": setup.source, "engine": start["engine"], "model": start["model"]},
        "workload": (run or {}).get("workload"), "load": ((run or {}).get("config") or {}).get("load"),
        "slo": trials.targets(setup.bench.slo), "budget": {"runs": setup.budget.runs, "minutes": setup.budget.minutes},
        "trials": rows, "changes": changes, "winning_profile": winner, "diff": profile_diff(start, winner),
        "slo_holds": run is not None and not trials.missed(run),
        "stopped": {"reason": stopped[0], "text": stopped[1]}, "passed_over": search.passed_over,
        "trade_off": trade_off_words(start, best, runner.offered_tok_s), "beside": beside(run, start["engine"]),
        "give": setup.give, "runs": show.runs, "wall_s": show.elapsed(), "engine_start_s": show.start_s or None,
        "interrupted": stopped[0] == "interrupted", "out": str(setup.out),
    }


def profile_yaml(profile: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(profile), sort_keys=False, allow_unicode=True, width=100)


def profile_diff(start: Mapping[str, Any], winner: Mapping[str, Any]) -> str:
    return "".join(difflib.unified_diff(profile_yaml(start).splitlines(True), profile_yaml(winner).splitlines(True),
                                        "start profile", "tuned profile"))


# ---------------------------------------------------------------------------------------------
# Against a server tune did not start

def measure(url: str, api_key: str | None, options: bench_options.BenchOptions, out: Path,
            say: Callable[[str], None] = printing.progress) -> dict[str, Any]:
    """One bench run and the change the diagnosis proposes: tune never restarts a server it did
    not start, so the change is a proposal with the commands that verify it."""
    say(f"tune: {url} was not started by tune: it is measured, never restarted; the change is proposed")
    began = time.monotonic()
    run = bench_once(url, api_key, options, out / f"{BASELINE}.json")
    d = diagnosis_of(run) or {}
    engine = ((run.get("server") or {}).get("metrics") or {}).get("engine") or "vllm"
    choice = proposal(run, {"engine": engine, "model": run["config"]["model"]})
    return {
        "kind": "tune", "schema_version": SCHEMA_VERSION, "mode": "measure_only", "url": url,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": run.get("workload"), "load": run["config"]["load"],
        "slo": trials.targets(options.slo),
        "trials": [trial_row(0, None, BASELINE, baseline_words(run), run=f"{BASELINE}.json",
                             figures=trials.figures(None, run), bench_s=time.monotonic() - began)],
        "slo_holds": not trials.missed(run),
        "proposal": None if choice.change is None else {
            "setting": choice.change.key, "flag": choice.change.flag, "from": choice.change.current,
            "to": choice.change.proposed, "reason": choice.change.reason},
        "passed_over": list(choice.passed_over), "verify": list(d.get("verify") or []),
        "beside": beside(run, engine), "runs": 1, "wall_s": time.monotonic() - began,
        "interrupted": run["interrupted"], "out": str(out),
    }


def proposal(run: Mapping[str, Any], profile: Mapping[str, Any]) -> levers.Choice:
    """The change to propose for the worst figure: the diagnosis's first lever that does not make
    it worse, else the first setting the figure depends on."""
    figure = trials.worst(run)
    choice = levers.first_change(diagnosis_of(run), profile, [], figure)
    if choice.change is not None or figure is None:
        return choice
    searched = levers.figure_change(figure, run, profile, [])
    return levers.Choice(searched.change, choice.passed_over + searched.passed_over)


# ---------------------------------------------------------------------------------------------
# A workload like the live traffic

def live_traffic_shape(url: str, api_key: str | None, window_s: float, timeout_s: float) -> dict[str, int]:
    """The traffic shape (traffic_shape) of the live server at `url` over `window_s` seconds of its
    /metrics, which are only read, its gauges once a second (doctor's window)."""
    (live,), _, _, interrupted = window.collect([url], api_key, timeout_s, window_s, lambda: None,
                                                "of the live traffic (--like)")
    if interrupted:
        raise KeyboardInterrupt
    return traffic_shape(engine_metrics.report(live.delta()))


def traffic_shape(report: Mapping[str, Any]) -> dict[str, int]:
    """Prompt and output tokens per request and requests in flight, from a metrics window of a
    live server (engine_metrics.window): what bench replays for `--like`. The lengths are those
    of the requests that finished in the window (their own histograms): the token counters also
    count the requests still running at its edges."""
    prompt, output = report.get("prompt_tokens_mean"), report.get("output_tokens_mean")
    if not report.get("requests") or prompt is None or report.get("mode") != "window":
        raise UsageError(f"{report.get('source')}: no request finished in the window, so its traffic has no "
                         "shape: measure a longer window (--like-window) while it serves")
    return {"input_tokens": max(1, round(prompt)),
            "output_tokens": max(1, round(output)) if output else 1,
            "concurrency": max(1, round(in_flight(report)))}


def in_flight(report: Mapping[str, Any]) -> float:
    """Requests in flight over a metrics window: the mean of the running and waiting gauges over
    their samples, which count them; with fewer than SAMPLED_ENOUGH samples, Little's law over the
    requests that finished in the window. That law rests on the few that finished: with answers
    longer than the window, one or two, and a fresh-clone run beside two busy loops read a closed
    loop of 3 as 1 in flight."""
    running, waiting = report.get("running_sampled_mean"), report.get("waiting_sampled_mean")
    if running is not None and (report.get("gauge_samples") or 0) >= SAMPLED_ENOUGH:
        return running + (waiting or 0)
    return (report.get("running_mean") or 0) + (report.get("waiting_mean") or 0)
