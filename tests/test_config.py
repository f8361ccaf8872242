"""Every config option composes; every invalid setting fails with one line before anything compiles."""
import subprocess
import sys

import pytest

from conftest import ROOT, compose
from shardlab.config import CONF_DIR

GROUPS = ["mesh", "model", "schedule", "train", "data", "precision", "hardware"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


@pytest.mark.slow
@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option):
  from shardlab.config import to_config
  from shardlab.validate import validate
  validate(to_config(compose(f"{group}={option}")))   # every preset, the FFN-only model's included


BAD = [
    (["mesh.fsdp=3", "mesh.tensor=3"], "mesh.fsdp=3 x mesh.tensor=3 = 9 devices, but 8"),
    (["mesh=1x8", "model.n_heads=4"], "model.n_heads=4 is not divisible by mesh.tensor=8"),
    (["model.d_ff=99"], "model.d_ff=99 is not divisible by mesh.tensor=2"),
    (["model.vocab_size=255"], "model.vocab_size=255"),
    (["mesh=8x1", "train.batch_size=12"], "train.batch_size=12 is not divisible by mesh.fsdp=8"),
    (["schedule=deferred_reduce", "train.batch_size=10", "mesh=2x4"], "mesh.fsdp * schedule.microbatches"),
    (["schedule.tp=ring_bidi", "model.seq_len=12", "mesh=2x4"], "model.seq_len=12"),
    (["schedule.tp=butterfly"], "schedule.tp=butterfly: unknown"),
    (["schedule.impl=magic"], "schedule.impl=magic: unknown"),
    (["schedule.prefetch=7"], "schedule.prefetch=7"),
    (["schedule=deferred_reduce", "schedule.prefetch=1"], "schedule.grad_reduce=deferred"),
    (["precision.compute_dtype=float16"], "precision.compute_dtype=float16"),
    (["checkpoint.every=-1"], "checkpoint.every=-1: must be >= 0"),
    (["checkpoint.keep=0"], "checkpoint.keep=0: must be >= 1"),
    (["distributed.num_processes=2"], "needs distributed.coordinator=HOST:PORT"),
    (["distributed.coordinator=node0"], "distributed.coordinator=node0: must be HOST:PORT"),
    (["distributed.coordinator=node0:1234", "distributed.num_processes=2", "distributed.process_id=2"],
     "distributed.process_id=2: must be in 0..distributed.num_processes-1"),
    (["layout.rules.embed=[tensor]"], "layout rule embed -> tensor: the tensor axis does not shard embed"),
    (["layout.rules.batch=[nowhere]"], "layout rule batch -> nowhere: no mesh axis 'nowhere' is declared"),
    (["layout.rules.mlp=[]"], "layout rule mlp -> none (replicated): schedule baseline cannot honour it"),
    (["mesh.pipeline=2", "mesh.fsdp=2"], "layout rule layers -> pipeline: schedule baseline cannot honour it"),
    (["mesh.context=2", "mesh.fsdp=2", "schedule=gspmd"], "layout rule length -> context: schedule gspmd cannot "
                                                            "honour it"),
    (["mesh.context=2", "mesh.fsdp=2", "model.attention=blockwise"], "model.attention=blockwise: context=all_gather "
                                                                     "runs the plain attention"),
    (["context=ulysses", "mesh.context=8", "mesh.fsdp=1", "mesh.tensor=1", "model.n_kv_heads=2"],
     "context=ulysses splits the heads over the context axes"),
    (["mesh.context=4", "mesh.fsdp=2", "mesh.tensor=1", "context.load_balance=true", "model.seq_len=36"],
     "model.seq_len=36 is not divisible by 2 * mesh.context=8 (context.load_balance=true"),
    (["mesh.context=8", "mesh.fsdp=1", "mesh.tensor=1", "model.seq_len=36"], "model.seq_len=36 is not divisible by "
                                                                            "mesh.context=8"),
    (["mesh=8x1", "model.d_model=20", "model.n_heads=2"], "model.d_model=20 is not divisible by mesh.fsdp=8 "
                                                          "(layout rule embed -> fsdp: embed dim 1)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_invalid_setting_is_one_line_before_compiling(overrides, message, tmp_path):
  from shardlab.config import to_config
  from shardlab.mesh import ConfigError
  from shardlab.run import train
  with pytest.raises(ConfigError) as e:
    train(to_config(compose(*overrides)), tmp_path / "run")
  assert message in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "run").exists(), "a failed config wrote output"


def test_cli_config_error_exits_2_with_one_line(tmp_path):
  r = subprocess.run([sys.executable, "-m", "shardlab", "mesh.fsdp=3", "mesh.tensor=3", f"hydra.run.dir={tmp_path}"],
                     capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert r.returncode == 2, r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("shardlab: error: mesh.fsdp=3"), r.stderr
  assert not (tmp_path / "summary.json").exists()


def test_a_model_changed_by_overrides_is_not_labelled_as_its_preset():
  """model=llama3_70b with its dimensions overridden is llama3_70b+overrides (the run's name, summary.json's model,
  the figures); a longer sequence or another attention kernel leaves the model what its preset names."""
  import dataclasses
  from shardlab.config import to_config
  m = to_config(compose("model=llama3_70b")).model
  assert m.label == "llama3_70b"
  assert dataclasses.replace(m, seq_len=32768, attention="dot_product").label == "llama3_70b"
  assert dataclasses.replace(m, d_model=16384, n_layers=126).label == "llama3_70b+overrides"
  assert to_config(compose("model.n_layers=4")).model.label == "tiny+overrides"


@pytest.mark.slow
def test_help_lists_only_real_choices():
  """--help: every group's options as one types them (model=llama3_8b), no structured-config schema among them."""
  r = subprocess.run([sys.executable, "-m", "shardlab", "--help"], capture_output=True, text=True, cwd=ROOT,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  groups = dict(l.split(": ", 1) for l in r.stdout.split("== Config ==")[0].splitlines() if ": " in l)
  assert "_schema" not in r.stdout.split("== Config ==")[0] and "llama3_8b" in groups["model"], r.stdout[:2000]
  assert "ragged" in groups["expert"] and "1f1b" in groups["pipeline"]


@pytest.mark.parametrize("override,message", [
    ("schedule.prefech=1", "Key 'prefech' not in 'ScheduleConfig'"),
    ("mesh.fsdp=two", "mesh.fsdp=two: Value 'two' of type 'str' could not be converted to Integer")])
def test_typo_in_override_is_rejected(override, message, tmp_path):
  """Hydra's own errors (unknown key, wrong type) come out as one line with exit code 2, like shardlab's."""
  r = subprocess.run([sys.executable, "-m", "shardlab", override, f"hydra.run.dir={tmp_path}"],
                     capture_output=True, text=True, cwd=ROOT, timeout=300)
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardlab: error: ") and message in lines[0], \
      r.stderr


def test_runs_are_named_by_what_they_ran():
  """A user's schedule class (and TP class) names the run directory and the summary, not the preset it started
  from; presets keep their names; the pipeline schedule and the context strategy follow where the mesh has
  those axes."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from shardlab.config import CONF_DIR, ScheduleConfig, register_configs
  assert ScheduleConfig().label == "baseline"
  assert ScheduleConfig(impl="my_sched:AllReduceSlice").label == "AllReduceSlice"
  assert ScheduleConfig(name="fsdp_prefetch", tp="my_tp:Mine").label == "fsdp_prefetch-Mine"
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    c = hydra_compose(config_name="config", overrides=["schedule.impl=my_sched:AllReduceSlice", "mesh.context=2",
                                                       "mesh.fsdp=2"], return_hydra_config=True)
    assert c.hydra.run.dir.endswith("_AllReduceSlice-all_gather_f2xc2xt2"), c.hydra.run.dir
    c = hydra_compose(config_name="config", overrides=["mesh.pipeline=2", "mesh.context=2", "mesh.fsdp=1",
                                                       "pipeline=1f1b", "context=ring", "context.load_balance=true"],
                      return_hydra_config=True)
    assert c.hydra.run.dir.endswith("_baseline-1f1b-ring-zigzag_p2xf1xc2xt2"), c.hydra.run.dir
    assert "_baseline_4x2" in hydra_compose(config_name="config", return_hydra_config=True).hydra.run.dir


def test_every_config_group_ships_in_the_wheel():
  """Each folder of conf/ is a package of pyproject.toml (shardlab.conf.<group>), so an installed shardlab has
  every Hydra group (a new group left out breaks `python -m shardlab` outside the source tree)."""
  import pathlib
  import tomllib
  root = pathlib.Path(__file__).resolve().parents[1]
  packages = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
  folders = {"shardlab.conf." + ".".join(p.relative_to(root / "conf").parts)
             for p in (root / "conf").rglob("*") if p.is_dir() and any(p.glob("*.yaml"))}
  assert folders <= packages, sorted(folders - packages)


def test_the_config_sets_no_hydra_mode_so_a_command_composes_once():
  """run._compose_once skips Hydra's first compose of every command (it only reads `hydra.mode`) because
  shardlab's config sets no mode: composed with the Hydra node, the mode is unset; a command line that sets one
  (or names another config) keeps Hydra's own get_mode."""
  from hydra import compose, initialize_config_dir
  from hydra._internal.hydra import Hydra
  from shardlab.config import CONF_DIR, register_configs
  from shardlab.run import _compose_once
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    assert compose(config_name="config", return_hydra_config=True).hydra.mode is None
  own = Hydra.get_mode
  with _compose_once(["train.steps=2"]):
    assert Hydra.get_mode is not own and Hydra.get_mode(None, "config", []) is None
  assert Hydra.get_mode is own
  for argv in (["hydra.mode=MULTIRUN"], ["--config-name", "other"], ["hydra.searchpath=[file:///tmp/more]"]):
    with _compose_once(argv):
      assert Hydra.get_mode is own
