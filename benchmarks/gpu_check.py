"""The stages of ``bash benchmarks/gpu_check.sh``, one per process: ``python -m benchmarks.gpu_check S [--dry-run]``.

Each stage runs its checks, prints one verdict line (``[S1] PASS|FAIL|SKIP (N s) ...``) and writes
``gpu_check_s<N>.json`` under ``--out``. A check passes, fails (an exception: its message is kept) or is
skipped (with a reason naming what did not run). The stage is FAIL if any check failed, else PASS if any
passed (the line still names every skip), else SKIP. ``--dry-run``: on CPU at tiny sizes, every part that
needs CUDA reported as a skip; what it proves is that the stages still run, not anything about a GPU.

  S0 facts: versions (torch, CUDA, cuDNN, NCCL, Triton, transformers, GPU), import dynashard, one compile,
     torchao float8 MLPs at simulated world 2 (benchmarks/gpu_float8.py)
  S1 pytest -m cuda, each SDPA backend forced in its own process (flash, efficient, cuDNN, math): HF
     Llama, Qwen2, GPT-2 in bf16 under explain(verify=True) and under Inductor (tests/test_cuda.py)
  S2 real ranks sharing cuda:0 over gloo (benchmarks/gpu_ranks.py)
  S3 NCCL at world 1 with device_id and its host companion group; mode="reduce-overhead" (tests/test_cuda.py)
  S4 a forecast of TP decode speedups (benchmarks/gpu_forecast.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("flash", "efficient", "cudnn", "math")
NO_CUDA = "no CUDA (dry run)"


class Skipped(Exception):
    """A check that did not run; the message names what and why."""


@dataclasses.dataclass
class Check:
    name: str
    verdict: str
    detail: str = ""
    data: Any = None


class Stage:
    """The checks of one stage, in order; each check's failure is recorded and the next one runs."""

    def __init__(self, key: str, title: str, dry: bool) -> None:
        self.key, self.title, self.dry, self.checks = key, title, dry, []
        self.facts: dict[str, Any] = {}
        self.started = time.perf_counter()

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            data = fn()
        except Skipped as e:
            self.checks.append(Check(name, "SKIP", str(e)))
            return None
        except Exception as e:  # noqa: BLE001 - a failed check is recorded; the stage goes on
            detail = f"{type(e).__name__}: {e}"[:3000] + "\n" + traceback.format_exc()[-3000:]
            self.checks.append(Check(name, "FAIL", detail))
            return None
        summary = data.pop("summary", "") if isinstance(data, dict) else ""
        self.checks.append(Check(name, "PASS", summary, data))
        return data

    def skip(self, name: str, reason: str) -> None:
        self.checks.append(Check(name, "SKIP", reason))

    @property
    def verdict(self) -> str:
        seen = {c.verdict for c in self.checks}
        return "FAIL" if "FAIL" in seen else "PASS" if "PASS" in seen else "SKIP"

    def line(self) -> str:
        secs = time.perf_counter() - self.started
        parts = [f"{c.name}: {c.detail}" if c.detail else c.name for c in self.checks if c.verdict == "PASS"]
        text = f"[{self.key.upper()}] {self.verdict} ({secs:.0f} s{', dry run' if self.dry else ''}) {self.title}"
        if parts:
            text += " | ran: " + "; ".join(parts)
        for verdict in ("FAIL", "SKIP"):
            named = [f"{c.name} ({c.detail.splitlines()[0][:200]})" for c in self.checks if c.verdict == verdict]
            if named:
                text += f" | {'failed' if verdict == 'FAIL' else 'not run'}: " + "; ".join(named)
        return text

    def write(self, out: str) -> str:
        path = os.path.join(out, f"gpu_check_{self.key}.json")
        rec = {"stage": self.key.upper(), "title": self.title, "verdict": self.verdict, "dry_run": self.dry,
               "seconds": round(time.perf_counter() - self.started, 1), "line": self.line(), **environment(),
               **self.facts, "checks": [dataclasses.asdict(c) for c in self.checks]}
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(rec, f, indent=1, default=str)
            f.write("\n")
        return path


def environment() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=ROOT).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "gpu": gpu, "cpus": os.cpu_count()}


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1"}


# --- pytest, in a process of its own, its outcomes read from its junit XML ----------------------------


def pytest_cases(selection: list[str], timeout: float) -> tuple[int, list[dict[str, Any]]]:
    """``python -m pytest -m cuda tests/test_cuda.py SELECTION`` (setup.cfg's addopts dropped: no xdist
    workers) and each test's outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-m", "cuda", "-q", "-rA",
               "tests/test_cuda.py", *selection, f"--junitxml={junit}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env())
        except subprocess.TimeoutExpired as e:
            said = _text(e.stdout)[-2000:]
            raise RuntimeError(f"pytest ran past {timeout:.0f} s: {' '.join(cmd[3:])}\n{said}") from None
        cases = []
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                outcome, detail = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        detail = (node.get("message") or node.text or "").strip()[:2000]
                        break
                cases.append({"test": case.get("name"), "outcome": outcome,
                              "seconds": round(float(case.get("time") or 0), 1), "detail": detail})
        if not cases:
            said = done.stdout[-3000:] + done.stderr[-2000:]
            raise RuntimeError(f"pytest ran no test (exit {done.returncode})\n{said}")
        return done.returncode, cases


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def judge(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """A check's result from pytest cases: raises if any failed, Skipped if none passed."""
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    bad = [c for c in cases if c["outcome"] in ("failed", "error")]
    if bad:
        raise AssertionError("; ".join(f"{c['test']}: {c['detail'][:400]}" for c in bad))
    if not counts["passed"]:
        raise Skipped("not run, every case skipped: " + "; ".join(f"{c['test']}: {c['detail'][:200]}" for c in cases))
    summary = f"{counts['passed']}/{len(cases)} passed"
    if counts["skipped"]:
        summary += ", skipped: " + "; ".join(f"{c['test']} ({c['detail'][:160]})" for c in cases
                                              if c["outcome"] == "skipped")
    return {"summary": summary, "counts": counts, "cases": cases}


# --- S0: the machine, the import, one compile -------------------------------------------------------


def s0_facts(st: Stage, args: argparse.Namespace) -> None:
    import torch

    def versions() -> dict[str, Any]:
        facts: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                                 "cuda_available": torch.cuda.is_available()}
        for name in ("triton", "transformers", "torchao", "pytest", "numpy", "safetensors"):
            try:
                facts[name] = __import__(name).__version__
            except Exception as e:  # noqa: BLE001 - a missing package is a fact to print
                facts[name] = f"missing ({type(e).__name__})"
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            facts.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30),
                         gpus=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version(),
                         nccl=".".join(map(str, torch.cuda.nccl.version())))
        st.facts["versions"] = facts
        keys = ("torch", "cuda_build", "gpu", "nccl", "cudnn", "triton", "transformers")
        return {"summary": ", ".join(f"{k} {facts.get(k)}" for k in keys if k in facts), **facts}

    def imported() -> dict[str, Any]:
        import dynashard

        where = os.path.dirname(os.path.abspath(dynashard.__file__))
        assert os.path.dirname(where) == ROOT, f"dynashard imported from {where}, expected this checkout {ROOT}"
        assert "dynashard" in torch.compiler.list_backends(), (
            "the 'dynashard' backend is not registered: the entry point comes from `pip install --no-deps -e .` "
            "(gpu_check.sh does it)")
        return {"summary": f"dynashard {dynashard.__version__} from {where}"}

    def one_compile() -> dict[str, Any]:
        import copy

        import torch.distributed as dist

        import dynashard
        from dynashard import _torch as private
        from tests import models

        device = "cpu" if args.dry_run else "cuda"
        compiler = "eager" if args.dry_run else "inductor"
        torch.manual_seed(0)
        mlp = models.MLP(256, 512).to(device).eval()
        x = torch.randn(4, 256, device=device)
        report = dynashard.explain(mlp, x, world_size=2, verify=True, options={"min_shard_numel": 0})
        private.init_fake_process_group(2, 0)
        try:  # rank 0's program: Inductor's against the same graph run by aten ops (the fake group adds nothing)
            with torch.no_grad():
                got = torch.compile(copy.deepcopy(mlp), backend="dynashard",
                                    options={"min_shard_numel": 0, "compiler": compiler})(x)
                torch.compiler.reset()
                want = torch.compile(copy.deepcopy(mlp), backend=dynashard.backend(compiler="eager",
                                                                                   min_shard_numel=0))(x)
        finally:
            dist.destroy_process_group()
            torch.compiler.reset()
        err = float((got - want).abs().max())
        assert err < 1e-4, f"{compiler} against eager, rank 0's program: {err}"  # fp32: the same sums reordered
        worst = max(g.output_err for g in report.graphs)
        return {"summary": f"MLP at world 2 on {device}, verify err {worst:.1e}, {compiler} vs eager {err:.1e}",
                "verify_err": worst, "compile_err": err}

    def float8() -> dict[str, Any]:
        from benchmarks.gpu_float8 import NoFloat8, explain_check

        try:
            return explain_check("cpu" if args.dry_run else "cuda")
        except NoFloat8 as e:
            raise Skipped(str(e)) from None

    st.run("versions", versions)
    st.run("import", imported)
    st.run("compile", one_compile)
    st.run("float8", float8)
    if args.dry_run:
        st.skip("cuda", f"{NO_CUDA}: the versions of CUDA, NCCL, cuDNN and the GPU, and the compile on a GPU "
                       "through Inductor (Triton) not run; the compile ran on CPU with compiler='eager'")


# --- S1: each SDPA backend forced, its own pytest process ----------------------------------------------


def _kernel_selection(kernel: str) -> list[str]:
    return ["-k", f"under_each_cuda_attention_kernel and {kernel}"]


def s1_kernels(st: Stage, args: argparse.Namespace) -> None:
    # one pytest process per kernel (a CUDA error poisons its process), all at once: they time nothing. The dry
    # run takes this path for one kernel, where pytest skips every case (no CUDA)
    kernels = ("math",) if args.dry_run else KERNELS
    procs = {}
    for k in kernels:
        procs[k] = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check", "s1-kernel", "--kernel", k,
                                     "--timeout", str(args.timeout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=ROOT, env=child_env())
    if args.dry_run:
        def collected() -> dict[str, Any]:  # what pytest would run on a GPU, read without a pytest process
            from tests import test_cuda

            per = {k: sum(c[0] == k for c in test_cuda.CASES) + sum(c[0] == k for c in test_cuda.INDUCTOR_CASES)
                   for k in KERNELS}
            assert all(per.values()) and set(test_cuda.KERNELS) == set(KERNELS), f"kernels without a case: {per}"
            for name in ("is_verified", "under_inductor"):
                assert callable(getattr(test_cuda, f"test_hf_model_in_bf16_under_each_cuda_attention_kernel_{name}"))
            return {"summary": f"cases per kernel and arch: {per}", "per_kernel": per}

        def on_cpu() -> dict[str, Any]:  # the test helpers themselves, with the only kernel CPU has
            from tests import test_cuda

            test_cuda.check_hf_kernel("llama", "math", "causal", device="cpu")
            err = test_cuda.check_hf_inductor("llama", "math", "mask", device="cpu", compiler="aot_eager")
            return {"summary": f"HF Llama bf16, math SDPA, on CPU: verified; aot_eager vs eager {err:.1e}"}

        st.run("collect", collected)
        st.run("llama/math on CPU", on_cpu)
        for k in KERNELS:
            if k not in kernels:
                st.skip(k, f"{NO_CUDA}: HF Llama/Qwen2/GPT-2 bf16 with SDPA {k} forced, verify and Inductor, not run")
    for k, proc in procs.items():
        def one(proc=proc, k=k) -> dict[str, Any]:
            out, _ = proc.communicate(timeout=args.timeout + 30)
            line = [x for x in out.splitlines() if x.startswith("{")]
            if not line:
                raise RuntimeError(f"the {k} process wrote no result (exit {proc.returncode})\n{out[-3000:]}")
            res = json.loads(line[-1])
            if res["error"]:
                raise RuntimeError(res["error"])
            return judge(res["cases"])
        st.run(k, one)


def s1_one_kernel(kernel: str, timeout: float) -> None:
    """In its own process: one kernel's cases; prints their outcomes as one JSON line."""
    try:
        _, cases = pytest_cases(_kernel_selection(kernel), timeout)
        print(json.dumps({"cases": cases, "error": None}))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        print(json.dumps({"cases": [], "error": f"{type(e).__name__}: {e}"}))


# --- S3: NCCL at world 1, CUDA graphs ----------------------------------------------------------------

S3_TESTS = {"nccl world 1": "host_messages", "reduce-overhead replay": "reduce_overhead_replays",
            "grown cache apart": "reduce_overhead_keeps_a_grown_cache"}


def s3_nccl_graphs(st: Stage, args: argparse.Namespace) -> None:
    if args.dry_run:
        def collected() -> dict[str, Any]:
            from tests import test_cuda

            found = [n for n in dir(test_cuda) if n.startswith("test_") and any(t in n for t in S3_TESTS.values())]
            assert len(found) == len(S3_TESTS), f"expected {len(S3_TESTS)} tests, found {found}"
            return {"summary": f"{len(found)} tests found"}

        st.run("collect", collected)
    try:  # one pytest process (the NCCL test starts its own); on CPU every test skips (no CUDA)
        cases, error = pytest_cases(["-k", " or ".join(S3_TESTS.values())], args.timeout)[1], None
    except Exception as e:  # noqa: BLE001 - each check below reports it
        cases, error = [], e
    for name, test in S3_TESTS.items():
        def one(test=test) -> dict[str, Any]:
            if error is not None:
                raise error
            mine = [c for c in cases if test in c["test"]]
            if not mine:
                raise RuntimeError(f"no test matching {test!r} ran: {[c['test'] for c in cases]}")
            return judge(mine)
        st.run(name, one)


# --- the driver ---------------------------------------------------------------------------------------

TITLES = {"s0": "versions, import, one compile", "s1": "HF bf16 under each forced SDPA backend: verify + Inductor",
          "s2": "real ranks on one GPU over gloo: logits, generate, a training step",
          "s3": "NCCL at world 1 (device_id, host companion), reduce-overhead replays",
          "s4": "FORECAST of TP decode speedups (not a measurement of TP)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=[*TITLES, "s1-kernel"])
    parser.add_argument("--dry-run", action="store_true", help="on CPU at tiny sizes; CUDA-only parts skipped")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--timeout", type=float, default=120, help="seconds for each subprocess of the stage")
    parser.add_argument("--kernel", choices=KERNELS)
    parser.add_argument("--layers", type=int, default=4, help="S4: layers of the 7B shape measured (of 32)")
    args = parser.parse_args(argv)
    if args.stage == "s1-kernel":
        s1_one_kernel(args.kernel, args.timeout)
        return 0
    st = Stage(args.stage, TITLES[args.stage], args.dry_run)
    if args.stage == "s2":
        from benchmarks.gpu_ranks import stage as body
    elif args.stage == "s4":
        from benchmarks.gpu_forecast import stage as body
    else:
        body = {"s0": s0_facts, "s1": s1_kernels, "s3": s3_nccl_graphs}[args.stage]
    try:
        body(st, args)
    except Exception as e:  # noqa: BLE001 - the stage's own code broke: a FAIL with its traceback
        st.checks.append(Check("stage", "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
    path = st.write(args.out)
    print(st.line(), flush=True)
    for c in st.checks:
        if c.verdict == "FAIL":
            print(f"    {c.name} FAILED:\n" + "\n".join("      " + x for x in c.detail.splitlines()[:40]), flush=True)
    print(f"    wrote {path}", flush=True)
    return 1 if st.verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
