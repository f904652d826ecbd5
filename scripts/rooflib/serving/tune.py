"""tune: from a diagnosis to a verified change, on an engine that tune starts and stops itself.

The loop: serve the profile, warm up and bench the baseline; read the diagnosis of that run (the
bench result carries engine_metrics' report of the run's /metrics window and timeline); turn the
plan's first lever tune may try into one profile change (levers.py); restart the engine with it,
bench the same workload with the same seed, compare the two runs and keep or revert the change
(trials.py); again until the SLO holds, no lever is left or the budget is spent. A setting with a
range is searched (bracket and bisect) before the next lever. Each run is written when it ends,
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
from typing import Any, Callable, Mapping

import yaml

from rooflib.core import cli, fileio, printing, signals
from rooflib.core.errors import ServerError, UsageError
from rooflib.load import asyncclient, benchrun, comparison
from rooflib.server import engine_metrics
from rooflib.server.deployment import Served
from rooflib.serving import levers, profiles, trials

SCHEMA_VERSION = 1
STOP_GRACE_S = 60.0  # an engine shuts down in seconds; past this it is killed
TEMPLATE = Path(__file__).resolve().parents[1] / "render" / "templates" / "tune_log_entry.md.j2"
BASELINE = "baseline"


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
    bench: benchrun.BenchOptions  # the workload and the SLO (bench.slo), every run's
    budget: Budget
    out: Path
    sizing: levers.Sizing | None
    startup_timeout_s: float


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


def start_engine(profile: Mapping[str, Any], port: int, log: Path, timeout_s: float) -> Engine:
    """Start the engine of `profile` in its own process group and wait until /health answers;
    UsageError for a port in use or no engine Python, ServerError when it does not start."""
    argv, env = profiles.render(dict(profile), port)
    host = profile.get("host", "127.0.0.1")
    profiles.check_port_free(host, port)
    began = time.monotonic()
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except FileNotFoundError:
            raise UsageError(f"engine Python {argv[0]!r} not found: install {profile['engine']} or set "
                             "ROOFLINE_ENGINE_PYTHON (for the CPU test engine: task setup-cpu-vllm)")
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

def bench_once(url: str, api_key: str | None, options: benchrun.BenchOptions, path: Path,
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


def warm_up(url: str, api_key: str | None, options: benchrun.BenchOptions) -> None:
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
            "engine_log": None, "vram": None, "note": None, **facts}


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
        """Bench the engine started from `profile`; the diagnosis is told the profile's settings."""
        options = self.setup.bench
        self.show(f"{name}: engine up and warm in {self.engine.start_s:.0f} s; bench ({options.num_requests} "
                  f"requests, {options.warmup} warm-up)")
        began = time.monotonic()
        self.show.runs += 1  # a run the engine crashed in counts against the budget too
        result = bench_once(self.engine.url, self.api_key, options, self.setup.out / f"{name}.json",
                            levers.served_with(profile, self.engine.url, self.setup.source))
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
        facts.update(run=f"{name}.json", bench_s=self.show.bench_s[-1], figures=trials.figures(None, result))
        if result["interrupted"]:
            return trial_row(n, change, trials.INTERRUPTED, "interrupted during the run: not judged", **facts), best
        if engine.proc.poll() is not None or (result["requests"]["failed"] and not serving(engine)):
            self.show(f"{name}: {change.describe()}: the engine crashed")
            self.stop()
            how = "stopped serving" if engine.proc.returncode is None else f"exited with status {engine.proc.returncode}"
            return trial_row(n, change, trials.CRASHED, f"the engine {how} during the run: "
                                                        f"{profiles.why_it_stopped(engine.log)}", **facts), best
        doc = compared(best.run, result, (best.file, f"{name}.json"))
        verdict = trials.judge(doc, best.run, result, target)
        facts["figures"] = trials.figures(doc, result)
        self.show(f"{name}: {change.describe()}: {verdict.decision}: {verdict.why}")
        row = trial_row(n, change, verdict.decision, verdict.why, **facts)
        return row, Measured(candidate, result, f"{name}.json") if verdict.decision == trials.KEPT else best


class Search:
    """Which change to try next: the next value of the setting being searched (trials.next_value),
    else the first lever of the diagnosis of the configuration kept so far that is not searched yet
    (levers.first_change); the levers passed over on the way, each said once."""

    def __init__(self) -> None:
        self.lever: levers.Change | None = None  # its value before the search, and the diagnosis's proposal
        self.tried: list[trials.Tried] = []
        self.done: list[str] = []
        self.passed_over: list[str] = []

    def next_change(self, best: Measured) -> levers.Change | None:
        while True:
            lever = self.lever
            value = trials.next_value(lever.key, lever.current, lever.proposed, self.tried) if lever else None
            if value is not None and value != best.profile.get(lever.key):
                return levers.Change(lever.key, lever.flag, best.profile.get(lever.key, lever.current), value,
                                     lever.reason)
            if lever is not None:
                self.done.append(lever.key)
            choice = levers.first_change(diagnosis_of(best.run), best.profile, self.done)
            self.passed_over += [line for line in choice.passed_over if line not in self.passed_over]
            if choice.change is None:
                return None
            self.lever, self.tried = choice.change, []

    def record(self, change: levers.Change, decision: str) -> None:
        self.tried.append(trials.Tried(change.proposed, decision))


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
                              bench_s=runner.show.bench_s[-1], engine_log="engine-0.log"))
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
                stopped = ("no_lever", no_lever_words(best.run, target))
                break
            spent = setup.budget.spent(runner.show.runs, runner.show.elapsed(), runner.show.trial_s())
            if spent:
                stopped = ("budget", f"{spent}; the next change would have been {change.describe()}")
                break
            row, best = runner.trial(len(rows), change, best, target)
            rows.append(row)
            if row["decision"] == trials.INTERRUPTED:
                raise KeyboardInterrupt
            search.record(change, row["decision"])
    except KeyboardInterrupt:
        stopped = ("interrupted", "interrupted: the trials done are kept")
    finally:
        runner.close()
    return document(setup, rows, best, stopped, search.passed_over, runner.show)


def profile_api_key(profile: Mapping[str, Any]) -> str | None:
    """The key the engine asks clients for: the profile's last --api-key in extra_args."""
    keys = [str(arg) for arg in profile.get("extra_args") or []]
    found = cli.flag_values(keys, profiles.API_KEY_FLAG)
    return found[-1] if found else None


def baseline_words(run: Mapping[str, Any]) -> str:
    missing = trials.missed(run)
    if not missing:
        return "the SLO holds"
    return "misses " + "; ".join(f"{trials.FIGURES[n][2]} {printing.fmt_number(run['slo'][n]['measured'], 1)} ms > "
                                 f"{run['slo'][n]['target']:g} ms" for n in missing)


def no_lever_words(run: Mapping[str, Any], target: str) -> str:
    d = diagnosis_of(run)
    root = (d or {}).get("root_cause")
    why = f"the diagnosis names {root['kind']} ({root['evidence']})" if root else \
        "the diagnosis finds no bottleneck in the engine's figures"
    return (f"no lever left that tune can try, and {trials.FIGURES[target][2]} still misses its target: {why}; "
            "what no setting of this profile fixes needs the proposals below (hardware, precision, the client)")


def document(setup: Setup, rows: list[dict[str, Any]], best: Measured | None, stopped: tuple[str, str],
             passed_over: list[str], show: Progress) -> dict[str, Any]:
    start, winner, run = dict(setup.profile), dict(best.profile if best else setup.profile), best.run if best else None
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
        "stopped": {"reason": stopped[0], "text": stopped[1]}, "passed_over": passed_over,
        "runs": show.runs, "wall_s": show.elapsed(), "engine_start_s": show.start_s or None,
        "interrupted": stopped[0] == "interrupted", "out": str(setup.out),
    }


def profile_yaml(profile: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(profile), sort_keys=False, allow_unicode=True, width=100)


def profile_diff(start: Mapping[str, Any], winner: Mapping[str, Any]) -> str:
    return "".join(difflib.unified_diff(profile_yaml(start).splitlines(True), profile_yaml(winner).splitlines(True),
                                        "start profile", "tuned profile"))


# ---------------------------------------------------------------------------------------------
# Against a server tune did not start

def measure(url: str, api_key: str | None, options: benchrun.BenchOptions, out: Path,
            say: Callable[[str], None] = printing.progress) -> dict[str, Any]:
    """One bench run and the change the diagnosis proposes: tune never restarts a server it did
    not start, so the change is a proposal with the commands that verify it."""
    say(f"tune: {url} was not started by tune: it is measured, never restarted; the change is proposed")
    began = time.monotonic()
    run = bench_once(url, api_key, options, out / f"{BASELINE}.json")
    d = diagnosis_of(run) or {}
    engine = ((run.get("server") or {}).get("metrics") or {}).get("engine") or "vllm"
    choice = levers.first_change(d, {"engine": engine, "model": run["config"]["model"]}, [])
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
        "runs": 1, "wall_s": time.monotonic() - began, "interrupted": run["interrupted"], "out": str(out),
    }


# ---------------------------------------------------------------------------------------------
# A workload like the live traffic

def live_traffic_shape(url: str, api_key: str | None, window_s: float, timeout_s: float) -> dict[str, int]:
    """The traffic shape (traffic_shape) of the live server at `url` over `window_s` seconds of its
    /metrics, which are only read."""
    text, began = engine_metrics.scrape(url, api_key, timeout_s)
    before = engine_metrics.snapshot(text, url, began)
    time.sleep(window_s)
    text, ended = engine_metrics.scrape(url, api_key, timeout_s)
    return traffic_shape(engine_metrics.window(before, engine_metrics.snapshot(text, url, ended)))


def traffic_shape(report: Mapping[str, Any]) -> dict[str, int]:
    """Prompt and output tokens per request and requests in flight, from a metrics window of a
    live server (engine_metrics.window): what bench replays for `--like`. The lengths are those
    of the requests that finished in the window (their own histograms): the token counters also
    count the requests still running at its edges."""
    prompt, output = report.get("prompt_tokens_mean"), report.get("output_tokens_mean")
    if not report.get("requests") or prompt is None or report.get("mode") != "window":
        raise UsageError(f"{report.get('source')}: no request finished in the window, so its traffic has no "
                         "shape: measure a longer window (--like-window) while it serves")
    in_flight = (report.get("running_mean") or 0) + (report.get("waiting_mean") or 0)
    return {"input_tokens": max(1, round(prompt)),
            "output_tokens": max(1, round(output)) if output else 1,
            "concurrency": max(1, round(in_flight))}
