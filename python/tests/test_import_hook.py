"""import_hook.when_imported: the callback runs once, right after the module's code, whether the
module is imported after the hook is set or was imported before; how shadowsync.vllm registers
its backends with vLLM whatever the import order."""

import sys

from shadowsync.vllm.import_hook import when_imported


def _write_package(root, name: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "factory.py").write_text("REGISTRY = []\n")


def test_the_callback_runs_right_after_a_later_import(tmp_path, monkeypatch):
    _write_package(tmp_path, "ss_hook_later")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("ss_hook_later.factory", lambda m: (seen.append(m), m.REGISTRY.append("ours")))
    when_imported("ss_hook_later.factory", seen.append)  # a second callback waits too
    assert seen == []  # nothing imported yet
    import ss_hook_later.factory as factory

    assert seen[0] is factory and factory.REGISTRY == ["ours"]
    assert seen == [factory, factory]
    import importlib

    importlib.reload(factory)  # the hooks were used up: no second run
    assert len(seen) == 2
    del sys.modules["ss_hook_later.factory"], sys.modules["ss_hook_later"]


def test_the_callback_runs_at_once_for_a_module_already_imported(tmp_path, monkeypatch):
    _write_package(tmp_path, "ss_hook_before")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ss_hook_before.factory as factory

    seen = []
    when_imported("ss_hook_before.factory", seen.append)
    assert seen == [factory]
    del sys.modules["ss_hook_before.factory"], sys.modules["ss_hook_before"]
