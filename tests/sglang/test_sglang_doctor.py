"""``sglang-bcg doctor`` (``doctor_main``): the checks an operator runs before serving."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from sglang_bcg_plugin.sglang.doctor import doctor_main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = doctor_main(list(argv), out=out)
    return code, out.getvalue()


def test_without_sglang_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # as if not installed
    code, text = run()
    assert code == 2 and "SGLang not installed" in text


def test_namespace_or_unregistered_sglang_is_not_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    from sglang_bcg_plugin.sglang import doctor

    (tmp_path / "sglang").mkdir()  # a bare directory: imports as a namespace package
    monkeypatch.setitem(sys.modules, "sglang", None)
    monkeypatch.delitem(sys.modules, "sglang")
    monkeypatch.syspath_prepend(str(tmp_path))
    if doctor.importlib.util.find_spec("sglang").origin is None:  # type: ignore[union-attr]
        assert run()[0] == 2

    def no_dist(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: type("Spec", (), {"origin": "x"})())
    monkeypatch.setattr(doctor.importlib.metadata, "version", no_dist)
    assert run() == (
        2,
        "SGLang not installed: install it into the serving environment "
        "(from a checkout of sglang_bcg_plugin: pip install -e '.[sglang]')\n",
    )


@pytest.mark.sglang
def test_all_targets_present(monkeypatch: pytest.MonkeyPatch, dist_dir: Path) -> None:
    import importlib.metadata

    from conftest import seam

    monkeypatch.syspath_prepend(str(dist_dir))  # our entry point, as pyproject.toml declares it
    monkeypatch.delenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", raising=False)
    code, text = run()
    assert code == 0, text
    assert f"SGLang {importlib.metadata.version('sglang')} (supported)" in text
    assert f"seam: {seam().describe()}" in text and "what the capture calls:" in text
    assert "MISSING" not in text and "NOT CHECKED" not in text and text.endswith("doctor: ok\n")
    assert "entry point (sglang.srt.plugins): sglang_bcg = sglang_bcg_plugin.sglang:register" in text
    policy = seam().builtin
    assert (
        f"--enable-bcg-shared-output (resolved now): {policy.default_mode} ({policy.default_reason()}); "
        "--enable-bcg-shared-output overrides it at launch"
    ) in text


@pytest.mark.sglang
def test_missing_target_exits_1(monkeypatch: pytest.MonkeyPatch, dist_dir: Path) -> None:
    import pkgutil

    from conftest import seam
    from sglang_bcg_plugin.sglang.doctor import OPT_IN_TARGETS
    from sglang_bcg_plugin.sglang.hooks import hooks_for

    # a seam hook (not an opt-in feature's): an SGLang upgrade moved it
    target = [t for t, _, _ in hooks_for(seam().kind) if t not in OPT_IN_TARGETS][-1]
    owner, _, name = target.rpartition(".")
    monkeypatch.syspath_prepend(str(dist_dir))
    monkeypatch.delattr(pkgutil.resolve_name(owner), name)
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    code, text = run()
    assert code == 1
    assert f"[MISSING] AROUND {target}" in text
    assert "on (SGLANG_ENABLE_BCG_SHARED_OUTPUT='1')" in text and "doctor: 1 seam(s) moved: this SGLang does not fit the plugin" in text


@pytest.mark.sglang
def test_missing_entry_point_and_bad_env_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from sglang_bcg_plugin.sglang import doctor

    monkeypatch.setattr(doctor.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(doctor.importlib.metadata, "version", lambda name: "0.6.0")
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "maybe")
    code, text = run()
    assert importlib.metadata.entry_points is doctor.importlib.metadata.entry_points
    assert code == 1
    assert "SGLang 0.6.0 (untested; supported: 0.5.13 to 0.5.23)" in text
    assert "NOT FOUND (expected sglang_bcg_plugin.sglang:register)" in text
    assert "invalid (SGLANG_ENABLE_BCG_SHARED_OUTPUT='maybe'" in text
    assert "doctor: entry point not discoverable: reinstall the plugin" in text


def test_check_names_the_import_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang_bcg_plugin.sglang.doctor import _diagnose

    def _check(target: str) -> str | None:
        problem = _diagnose(target)
        return None if problem is None else problem.detail

    (tmp_path / "bcg_needs_missing_dep.py").write_text("import bcg_no_such_dependency\n")
    (tmp_path / "bcg_raises_on_import.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _check("json.JSONDecoder.decode") is None
    assert _check("bcg_needs_missing_dep.Thing") == (
        "cannot import bcg_needs_missing_dep: No module named 'bcg_no_such_dependency'"
    )
    assert _check("bcg_raises_on_import.Thing.method") == "cannot import bcg_raises_on_import: RuntimeError: boom"
    assert _check("json.NoSuchThing.attr") == "AttributeError: module 'json' has no attribute 'NoSuchThing'"
    assert _check("bcg_no_such_package.sub.Thing").startswith("ModuleNotFoundError: No module named 'bcg_no_such_package'")


def test_diagnose_tells_causes_apart(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang_bcg_plugin.sglang.doctor import Problem, _diagnose

    (tmp_path / "bcg_needs_missing_dep.py").write_text("import bcg_no_such_dependency\n")
    pkg = tmp_path / "bcg_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import bcg_pkg.gone\n")  # the package's own module is missing
    monkeypatch.syspath_prepend(str(tmp_path))
    dep = _diagnose("bcg_needs_missing_dep.Thing")
    assert dep is not None and (dep.kind, dep.dependency) == ("dependency", "bcg_no_such_dependency")
    internal = _diagnose("bcg_pkg.mod.Thing")
    assert internal is not None and internal.kind == "import" and "bcg_pkg.gone" in internal.detail
    assert _diagnose("json.NoSuchThing") == Problem("moved", "AttributeError: module 'json' has no attribute 'NoSuchThing'")


def test_summary_groups_findings_by_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang import doctor
    from sglang_bcg_plugin.sglang.doctor import Problem

    dep = Problem("dependency", "cannot import x: No module named 'torchvision'", "torchvision")
    monkeypatch.setattr(doctor, "_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(doctor, "_entry_point", lambda: "sglang_bcg = sglang_bcg_plugin.sglang:register")
    monkeypatch.setattr(doctor, "_diagnose", lambda name: dep if "model_executor." in name else None)
    monkeypatch.setattr(doctor, "seam_kind", lambda: "backend")
    import torch

    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    code, text = run()
    assert code == 3, text
    assert text.count("[NOT CHECKED]") == 3, text
    assert "MISSING" not in text and text.count("pip install") == 1
    assert text.endswith(
        "doctor: SGLang could not be imported: dependency 'torchvision' is missing (torch 2.13.0+cpu is a CPU "
        "build from PyTorch's own wheels, and PyPI's torchvision is built for PyPI's torch and does not load with "
        "it: install the CPU build of torchvision 0.28 (the release made for torch 2.13.0), pip install "
        "'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu; the plugin itself does not "
        f"import torchvision, SGLang's modules do); 3 name(s) could not be checked\n"
    )
    other = Problem("dependency", "cannot import y: No module named 'orjson'", "orjson")
    assert "(install it into this environment: SGLang imports it)" in doctor._summary([other], entry_point_found=True)[0][0]
    moved = Problem("moved", "AttributeError: gone")
    broken = Problem("import", "cannot import y: RuntimeError: boom")
    lines, code = doctor._summary([moved, dep, broken, broken], entry_point_found=True)
    assert code == 1 and lines[0].startswith("doctor: 1 seam(s) moved") and len(lines) == 3
    assert lines[2] == "doctor: SGLang could not be imported: cannot import y: RuntimeError: boom"
    assert doctor._summary([broken], entry_point_found=True)[1] == 3
    assert doctor._summary([], entry_point_found=True) == (["doctor: ok"], 0)


def test_torchvision_advice_names_a_release_that_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Doctor advised "the torchvision build made for the installed torch 2.13.0+cpu", which PyPI
    does not have (its torchvision 0.28.0 requires torch==2.13.0 but is built for PyPI's torch and
    fails to import with 2.13.0+cpu): it names the release paired with the torch and, for a CPU
    torch, where its CPU build is."""
    import torch

    from sglang_bcg_plugin.sglang import doctor

    assert [doctor.torchvision_for(v) for v in ("2.13.0+cpu", "2.0.1", "2.13", "1.13.1", "3.0.0")] == ["0.28", "0.15", "0.28", None, None]
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    cpu = doctor._advice("torchvision")
    assert "pip install 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "build made for the installed torch" not in cpu and "the plugin itself does not import torchvision" in cpu
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert doctor._advice("torchvision") == (
        "install torchvision 0.28 (the release made for torch 2.13.0) into this environment, pip install "
        "'torchvision==0.28.*', keeping that torch (a torchvision built for another torch makes pip replace torch)"
    )
    monkeypatch.setattr(torch, "__version__", "3.0.0")
    assert doctor._advice("torchvision").startswith("install the torchvision build made for the installed torch 3.0.0")
    assert doctor._advice("triton").startswith("install the triton build made for the installed torch 3.0.0")


@pytest.mark.sglang
def test_missing_torchvision_is_named_not_moved(dist_dir: Path) -> None:
    """The README's test environment has no torchvision (no build for CPU torch 2.13)."""
    import os
    import subprocess

    code = (
        "import sys; sys.modules['torchvision'] = None; "
        f"sys.path.insert(0, {str(dist_dir)!r}); "
        "from sglang_bcg_plugin.sglang.doctor import doctor_main; sys.exit(doctor_main([]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_BCG_SHARED_OUTPUT"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                          cwd=str(root), env=env, timeout=300, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "MISSING" not in proc.stdout and "seam(s) moved" not in proc.stdout
    assert "doctor: SGLang could not be imported: dependency 'torchvision' is missing" in proc.stdout
