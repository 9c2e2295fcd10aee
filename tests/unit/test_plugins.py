"""The plugin lists come from the registries themselves, without torch, and every plugin is offered and documented.

Built-in plugins are declared by name in torch-free modules (:meth:`fedcore.registry.Registry.declare`); the CLIs'
choice lists and help texts (:mod:`fedcore.plugins`) and the configuration reference read the registries, so a
plugin registered anywhere shows up everywhere, with no generated file to keep current. ``import fedcore.config``
loads no torch (checked in a fresh interpreter), and a declaration agrees with what its module registers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcore import config_doc
from fedcore import plugins as names

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it prints one JSON object, returned."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    found: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return found


def test_importing_the_configuration_and_the_plugin_lists_loads_no_torch() -> None:
    found = _fresh("import json, sys\n"
                   "import fedcore.config, fedcore.plugins, fedcore.config_doc\n"
                   "from fedcore.config import ServerConfig, ClientConfig, from_dict\n"
                   "cfg = from_dict(ServerConfig, {'aggregation': {'rule': 'krum', 'options': {'krum_f': 1}},\n"
                   "    'simulation_harness': {'attack': {'kind': 'stat_opt', 'knowledge': 'full'}}})\n"
                   "ClientConfig(); lists = fedcore.plugins.listed()\n"
                   "print(json.dumps({'torch': 'torch' in sys.modules, 'rules': len(lists['RULES']),\n"
                   "                  'models': len(lists['MODELS'])}))")
    assert found == {"torch": False, "rules": 7, "models": 14}


def test_the_declared_lists_are_what_the_modules_register() -> None:
    """A fresh interpreter lists the declarations, imports every implementation, and lists again: the same names
    and the same one lines (a declaration cannot drift from its module)."""
    found = _fresh("import json\n"
                   "from fedcore import plugins\n"
                   "before = [plugins.listed(), plugins.summaries()]\n"
                   "for reg in plugins.registries().values():\n"
                   "    for name in reg.names():\n"
                   "        reg.get(name)\n"
                   "after = [plugins.listed(), plugins.summaries()]\n"
                   "undeclared = sorted(n for reg in plugins.registries().values() for n in reg.names()\n"
                   "                    if reg.declared_in(n))\n"
                   "print(json.dumps({'same': before == after, 'left': undeclared}))")
    assert found == {"same": True, "left": []}


def test_the_summaries_are_one_short_line_each_and_every_plugin_has_one() -> None:
    summaries = names.summaries()
    for key in ("TRAINERS", "RULES", "DETECTORS", "ATTACKS", "PARTITIONS", "DATASETS", "MODELS"):
        assert set(summaries[key]) == set(names.listed()[key]), key
        for name, line in summaries[key].items():
            assert line and "\n" not in line and len(line) <= 100, (key, name, line)


def test_every_registered_name_is_in_the_configuration_reference() -> None:
    text, _ = config_doc.generate()
    for key, registered in names.listed().items():
        if key in config_doc.PLUGIN_SLOTS:
            missing = [n for n in registered if f"`{n}`" not in text]
            assert not missing, (key, missing)


def test_a_newly_registered_plugin_appears_in_the_lists() -> None:
    from fedcore.nfl.config import DETECTORS

    DETECTORS.add("always_fine", lambda s, obs, config: [], summary="never reports NFL")
    try:
        assert "always_fine" in names.names("DETECTORS")
        assert "always_fine: never reports NFL" in names.described("DETECTORS")
        text, _ = config_doc.generate()
        assert "| `always_fine` | never reports NFL |" in text
    finally:
        DETECTORS.remove("always_fine")
    assert "always_fine" not in names.names("DETECTORS")


@pytest.mark.parametrize("key", ["TRAINERS", "DETECTORS", "ATTACKS"])
def test_described_gives_every_name_with_its_line(key: str) -> None:
    text = names.described(key)
    for name in names.listed()[key]:
        assert f"{name}: {names.summaries()[key][name]}" in text


def test_every_trainer_declares_the_options_its_factory_reads() -> None:
    from fedcore.errors import ConfigError
    from fedcore.train.trainers import TRAINERS, make_trainer

    for name in TRAINERS.names():
        options_type = TRAINERS.plugin(name).options_type()
        make_trainer(name, {})  # the defaults build
        if options_type is not None:
            fields = [f for f in dataclasses.fields(options_type) if f.init]
            assert TRAINERS.parse_options(name, {}, "recovery.options") == options_type(), name
            make_trainer(name, {fields[0].name: getattr(options_type(), fields[0].name)})  # its field is read
        with pytest.raises(ConfigError):
            make_trainer(name, {"no_such_option": 1})
        with pytest.raises(ConfigError, match=r"^recovery\.options"):
            TRAINERS.parse_options(name, {"no_such_option": 1}, "recovery.options")
