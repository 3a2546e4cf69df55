"""Hydra at the entry point: ``glm5 sft`` and ``glm5 rl`` are Hydra apps over typed schemas.

- ``register()``: the schemas in Hydra's ConfigStore — ``glm5_sft`` (``recipes.sft_config.SFTConfig``) and
  ``glm5_rl`` (``rl.config.RLConfig``), the first entry of the defaults list of ``configs/sft.yaml`` /
  ``configs/rl/*.yaml``, so OmegaConf checks every YAML value and override against the dataclass — and the
  Hydra settings our runs use (``hydra/output=glm5_<kind>``, ``hydra/help=glm5_<kind>``: the help lists the
  preset groups and every field with its doc).
- ``run_app(kind, argv, task)``: Hydra's command line (``--help``, ``--cfg job``, ``-m``, ``--config-path`` /
  ``--config-name``, ``key=value``, ``+key=value``, ``~key``; ``key=value`` also adds a key to a free-form
  mapping, ``plain_adds``), with the project's ``--config NAME`` kept; a
  bad config raises a one-line ValueError naming the key (``glm5 sft: error: config: ...``, exit 2).
- Run folders. Hydra itself writes nothing (``hydra.run.dir`` is ``.``, ``output_subdir`` null, no log
  files): the run folder is the recipe's ``train.out`` / ``trainer.out``, which the recipe checks with the
  output guard (``glm5_mcore.training.resume.claim_run_dir``) and its resume guard before the entry point saves the
  job's resolved config in ``OUT/.hydra/config.yaml`` (+ ``overrides.yaml``, ``save_job_config``);
  ``glm5 sft --config-path OUT/.hydra --config-name config [train.out=NEW]`` repeats the job. Under ``-m``
  the out folder is the sweep's root — claimed as ``<kind> multirun`` by ``SweepRootGuard`` before Hydra's
  sweeper writes ``multirun.yaml`` there — and job N runs in ``OUT/N`` (``hydra.sweep.subdir`` is Hydra's
  ``${hydra.job.num}``), each claimed by the recipe like a single run's.
- ``compose(name, overrides)``: the same config, composed without running (``glm5 plan``, tests).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
import typing
from pathlib import Path
from typing import Callable

from hydra.experimental.callback import Callback

CONFIG_DIR = Path(os.environ.get("GLM5_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))
OUT_SECTION = {"sft": "train", "rl": "trainer"}
"""The section whose ``out`` is the run folder."""
INPUTS = {"sft": ("model.hf_dir", "model.ckpt", "data.train", "data.valid"),
          "rl": ("model.hf_dir", "model.ckpt", "data.train", "data.val")}
"""Keys naming inputs a run folder must neither be, lie inside nor contain (the recipes' own lists)."""
GROUPS = {"sft": ("model", "parallel", "lora", "optim", "wandb"), "rl": ("model", "lora", "wandb")}


def _schema(kind: str):
    if kind == "sft":
        from recipes.sft_config import SFTConfig

        return SFTConfig
    from rl.config import RLConfig

    return RLConfig


def _source(kind: str) -> tuple[Path, str]:
    """(config folder of the primary configs, default config name)."""
    return (CONFIG_DIR, "sft") if kind == "sft" else (CONFIG_DIR / "rl", "grpo_tiny")


def _groups_text(kind: str) -> list[str]:
    """``group: option  first comment line`` for each preset file under ``configs/<group>/``."""
    lines = []
    for group in GROUPS[kind]:
        lines.append(f"  {group}:")
        for f in sorted((CONFIG_DIR / group).glob("*.yaml")):
            first = next((ln.lstrip("# ").strip() for ln in f.read_text().splitlines() if ln.startswith("#")), "")
            lines.append(f"      {f.stem:<14} {first}")
    return lines


def _help_template(kind: str) -> str:
    from glm5_mcore.training.schema import describe_fields

    out = OUT_SECTION[kind]
    fields = "\n".join(describe_fields(_schema(kind))).replace("$", "$$")
    return "\n".join([
        "${hydra.help.header}",
        f"Config groups (GROUP=OPTION picks configs/GROUP/OPTION.yaml; `glm5 {kind} --cfg job GROUP=OPTION` "
        "shows the result):",
        "\n".join(_groups_text(kind)).replace("$", "$$"),
        "",
        "Fields (KEY=VALUE sets one, also a key of a free-form mapping such as rollout.engine_kwargs (+KEY=VALUE "
        "too), ~KEY deletes one; values are",
        "checked against the schema, impossible settings refused before any work):",
        fields,
        "",
        f"Runs: the run folder is {out}.out (checked like every --out; the resolved config is saved in "
        f"{out}.out/.hydra/config.yaml;",
        f"`glm5 {kind} --config-path RUN/.hydra --config-name config {out}.out=NEW` repeats the job). "
        f"-m sweeps (`glm5 {kind} -m KEY=a,b`) run each",
        f"job in its own folder {out}.out/N (N = Hydra's job number); the sweep writes multirun.yaml in {out}.out.",
        "",
        "The composed config:",
        "$CONFIG",
        "Hydra flags:",
        "$FLAGS_HELP",
        "${hydra.help.footer}",
    ])


_REGISTERED: set = set()


def register(kind: str) -> None:
    """Schema and Hydra settings of ``kind`` in Hydra's ConfigStore (once per process)."""
    if kind in _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=f"glm5_{kind}", node=_schema(kind))
    out = OUT_SECTION[kind]
    cs.store(group="hydra/output", name=f"glm5_{kind}", package="hydra", node={
        "run": {"dir": "."}, "sweep": {"dir": "${" + out + ".out}", "subdir": "${hydra.job.num}"},
        "callbacks": {"glm5_sweep_root": {"_target_": f"{__name__}.SweepRootGuard", "kind": kind}}})
    what = "SFT / continued pretraining" if kind == "sft" else "GRPO / PPO with Ray"
    cs.store(group="hydra/help", name=f"glm5_{kind}", package="hydra.help", node={
        "app_name": f"glm5 {kind}",
        "header": f"glm5 {kind}: {what} (Hydra app; schema: "
                  f"{'recipes/sft_config.py' if kind == 'sft' else 'rl/config.py'}, configs: {_source(kind)[0]}).\n"
                  f"Usage: glm5 {kind} [--config NAME] [--cfg job] [-m] [GROUP=OPTION ...] [KEY=VALUE ...]\n",
        "footer": "", "template": _help_template(kind)})
    _REGISTERED.add(kind)


def _settings(kind: str) -> list[str]:
    """The Hydra overrides every run of ours gets (before the user's, which win)."""
    return [f"hydra/output=glm5_{kind}", f"hydra/help=glm5_{kind}", "hydra/job_logging=none",
            "hydra/hydra_logging=none", "hydra.output_subdir=null", "hydra.job.chdir=false",
            f"hydra.searchpath=['file://{CONFIG_DIR}']"]


def shipped_config(name: str, kind: str | None = None) -> str:
    """A shipped config's name as ``compose`` takes it: ``rl/NAME`` for an RL preset (``configs/rl/NAME.yaml``),
    ``NAME`` for an SFT one (``configs/NAME.yaml``), whether ``--config`` said ``rl/NAME`` or ``NAME`` (and with
    or without ``.yaml``): ``glm5 rl`` and ``glm5 plan`` take both spellings. ``kind`` ("rl" for ``glm5 rl``,
    ``glm5 plan --kind``) decides a bare name; without it a bare name is SFT's where ``configs/NAME.yaml`` is
    there, else RL's where ``configs/rl/NAME.yaml`` is. A name of neither is left for ``compose`` to name."""
    name = name[:-5] if name.endswith(".yaml") else name
    bare = name[3:] if name.startswith("rl/") else name
    if name.startswith("rl/") or kind == "rl":
        return f"rl/{bare}"
    if kind is None and not (CONFIG_DIR / f"{bare}.yaml").is_file() and (CONFIG_DIR / "rl" / f"{bare}.yaml").is_file():
        return f"rl/{bare}"
    return bare


def _in_free_form(schema, key: str) -> bool:
    """Whether the dotted ``key`` names an entry inside a free-form mapping field of the dataclass ``schema``
    (``rollout.engine_kwargs.stream``: ``engine_kwargs`` is a ``dict``), not a field or the mapping itself."""
    t, parts = schema, key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(t):
            return False
        t = typing.get_type_hints(t).get(part)
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:  # Optional[X]
            t = args[0]
        if t is dict or typing.get_origin(t) is dict:
            return i < len(parts) - 1
    return False


def plain_adds(kind: str, overrides: list[str]) -> list[str]:
    """``overrides`` with ``KEY=VALUE`` inside a free-form mapping as Hydra's ``++KEY=VALUE`` (add the key, or set
    it where a preset has it): ``rollout.engine_kwargs.stream=false`` works as typed, where Hydra wants ``+`` for
    a key the composed config lacks and refuses it otherwise ("unknown field")."""
    schema = _schema(kind)
    return [f"++{o}" if "=" in o and not o.startswith(("+", "~")) and _in_free_form(schema, o.split("=", 1)[0])
            else o for o in overrides]


def _argv(kind: str, argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra flags, overrides) of ``argv``: ``--config NAME`` is ``--config-name NAME`` (``glm5 rl``: ``rl/NAME``
    too, ``shipped_config``, unless ``--config-path`` names another folder); ``--config-path`` is taken relative to
    the working directory; ``--cfg`` / ``--help`` print the resolved config."""
    from hydra._internal.utils import get_args_parser

    argv = list(argv)
    own_folder = not any(a in ("--config-path", "-cp") or a.startswith("--config-path=") for a in argv)

    def name(value: str) -> str:
        return shipped_config(value, "rl")[3:] if kind == "rl" and own_folder else value

    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            argv[i], argv[i + 1] = "--config-name", name(argv[i + 1])
        elif a.startswith("--config="):
            argv[i] = "--config-name=" + name(a.split("=", 1)[1])
    ns = get_args_parser().parse_intermixed_args(argv)
    flags = list(argv)
    for o in ns.overrides:
        flags.remove(o)
    for i, a in enumerate(flags):
        if a in ("--config-path", "-cp") and i + 1 < len(flags):
            flags[i + 1] = os.path.abspath(flags[i + 1])
        elif a.startswith("--config-path="):
            flags[i] = "--config-path=" + os.path.abspath(a.split("=", 1)[1])
    if (ns.cfg in ("job", "all") or ns.help) and not ns.resolve:
        flags.append("--resolve")
    return flags, plain_adds(kind, list(ns.overrides))


def _one_line(kind: str, e: BaseException) -> str:
    """A Hydra / OmegaConf error as one line naming the key (the OmegaConf cause when there is one)."""
    from omegaconf.errors import OmegaConfBaseException

    from glm5_mcore.training.schema import error_message

    cause = e
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if cause is not None:
        return error_message(_schema(kind), cause)
    text = str(e).split("\nConfig search path")[0]
    return "config: " + " ".join(text.split())


def _flag(flags: list[str], names: tuple[str, ...]):
    """The value of the last of ``names`` in ``flags`` (``--x V`` or ``--x=V``), or None."""
    value = None
    for i, a in enumerate(flags):
        if a in names and i + 1 < len(flags):
            value = flags[i + 1]
        elif "=" in a and a.split("=", 1)[0] in names:
            value = a.split("=", 1)[1]
    return value


def yaml_error_line(e, path=None) -> str:
    """A PyYAML error as ``FILE: not valid YAML (problem, line L column C)``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = path or (mark.name if mark is not None else "config")
    at = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{where}: not valid YAML ({getattr(e, 'problem', None) or e}{at})"


def check_primary_config(kind: str, flags: list[str]) -> None:
    """The job's primary YAML (``--config-path`` / ``--config-name``, else the recipe's default) parses, and
    is this recipe's: a config saved by the other recipe (``glm5 rl``'s ``trainer:`` under ``glm5 sft``)
    is one line naming the file and the command that reads it."""
    import yaml

    folder, name = _source(kind)
    folder = Path(_flag(flags, ("--config-path", "-cp")) or folder)
    name = _flag(flags, ("--config-name", "-cn")) or name
    path = folder / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        return  # Hydra's own "cannot find primary config" names it
    try:
        d = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(yaml_error_line(e, path)) from None
    other = "rl" if kind == "sft" else "sft"
    if isinstance(d, dict) and OUT_SECTION[other] in d and OUT_SECTION[kind] not in d:
        raise ValueError(f"{path}: a glm5 {other} config (it has a '{OUT_SECTION[other]}:' section, glm5 {kind} "
                         f"has '{OUT_SECTION[kind]}:'); run it with glm5 {other} --config-path {folder} "
                         f"--config-name {name}")


def run_app(kind: str, argv: list[str], task: Callable) -> int:
    """Run Hydra's command line for ``kind`` ("sft" | "rl") with ``task(cfg: DictConfig)`` per job."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import yaml

    register(kind)
    flags, overrides = _argv(kind, argv)
    check_primary_config(kind, flags)
    failed: list[BaseException] = []

    @functools.wraps(task)
    def job(cfg) -> None:
        try:
            task(cfg)
        except OmegaConfBaseException as e:  # e.g. a ``???`` left in the job's config
            failed.append(ValueError(_one_line(kind, e)))
        except Exception as e:  # reported by us, once (not Hydra's "Error executing job" line + re-raise)
            failed.append(e)

    config_dir, name = _source(kind)
    saved = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [f"glm5 {kind}", *flags, *_settings(kind), *overrides]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # errors reach us (one line, exit 2), not Hydra's report + exit 1
    try:
        hydra.main(config_path=str(config_dir), config_name=name, version_base=None)(job)()
    except SystemExit as e:  # --help
        if e.code not in (0, None):
            raise
    except SweepRefused as e:
        raise ValueError(str(e)) from None
    except yaml.YAMLError as e:  # a defaults-list file of --config-path
        raise ValueError(yaml_error_line(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(kind, e)) from None
    finally:
        sys.argv = saved[0]
        if saved[1] is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved[1]
    if failed:  # under -m every job ran; the first failure is the command's error
        raise failed[0]
    return 0


def job_dict(kind: str, cfg) -> dict:
    """The job's resolved config as a plain dict; under ``-m`` its run folder is ``OUT/<job number>``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        sec = d.setdefault(OUT_SECTION[kind], {})
        sec["out"] = str(Path(str(hc.sweep.dir)) / str(hc.job.num))
    return d


def save_job_config(out: str, d: dict) -> None:
    """``out/.hydra/config.yaml`` (the job's resolved config) and ``overrides.yaml`` (its command-line
    overrides), each written to a temporary file and renamed into place."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    folder = Path(out) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    for fname, obj in (("config.yaml", d), ("overrides.yaml", overrides)):
        tmp = folder / f".{fname}.tmp-{os.getpid()}"
        tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(obj)))
        os.replace(tmp, folder / fname)


class SweepRefused(BaseException):
    """The sweep root is refused. A BaseException: Hydra turns a callback's Exception into a warning
    (hydra/_internal/callbacks.py:27) and would go on to write into the folder."""


class SweepRootGuard(Callback):
    """Under ``-m``: the sweep's root (``train.out`` / ``trainer.out``) goes through the output guard and is
    marked ``<kind> multirun`` before Hydra's sweeper creates it and writes ``multirun.yaml`` there."""

    def __init__(self, kind: str):
        self.kind = kind

    def on_multirun_start(self, config, **kwargs) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        from glm5_mcore.training.resume import claim_run_dir

        key = f"{OUT_SECTION[self.kind]}.out"
        for o in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
            if o.key_or_group == key and o.is_sweep_override():
                raise SweepRefused(f"{key}: the sweep's root folder (job N runs in {key}/N); give one folder")
        inputs = [OmegaConf.select(config, k, default=None) for k in INPUTS[self.kind]]
        try:
            claim_run_dir(str(config.hydra.sweep.dir), f"{self.kind} multirun", inputs)
        except (ValueError, OSError) as e:
            raise SweepRefused(str(e)) from None


def compose(name: str, overrides: list[str], require_all: bool = True) -> dict:
    """The resolved config ``configs/{name}.yaml`` (``sft``, ``sft_glm5_744b_lora``, ``rl/grpo_tiny`` ...) with
    command-line ``overrides``, as a plain dict (``require_all=False``: ``???`` values are left as they are,
    for ``glm5 plan``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    kind = "rl" if name.startswith("rl/") else "sft"
    config_dir = _source(kind)[0]
    short = name[3:] if kind == "rl" else name
    if not (config_dir / f"{short}.yaml").is_file():
        raise FileNotFoundError(f"{config_dir / (short + '.yaml')}: missing; run from a source checkout "
                                "(pip install -e .) or set GLM5_CONFIG_DIR")
    register(kind)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = hydra_compose(config_name=short, overrides=[_settings(kind)[-1], *plain_adds(kind, overrides)])
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=require_all)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"configs/{name}.yaml + overrides: {_one_line(kind, e)}") from None
    finally:
        GlobalHydra.instance().clear()
