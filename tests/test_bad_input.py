"""Every kind of bad input stops before training with one clear sentence and exit code 2.

Each mistake of the command line is run as `python -m frontier.train` runs it, with Hydra's run and
sweep directories, the MLflow store and the data caches pointed into an empty folder, and must leave
that folder empty: nothing is written for a command that is refused. The tables run in the test's own
process (runpy, as `python -m` runs a module: a process's start and imports cost several times the
refusal); a spread of each table also runs as a process of its own, which must say the same.
"""
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import FAST, ROOT, command_in_process, run_cli, spread

MODELS = "base, "  # the start of the list of model presets

# (arguments after the base command line, the start of the one sentence after "error: ")
BAD = [
    # keys the schema does not have, added with + or set directly
    (["+foo=1"], "foo=1 is not allowed: the config has no key 'foo'; its keys are model, optim"),
    (["+model.foo=1"], "model.foo=1 is not allowed: model has no key 'foo'; its keys are name, depth"),
    (["+train.foo=1"], "train.foo=1 is not allowed: train has no key 'foo'; its keys are batch_tokens"),
    (["++model.foo=2"], "model.foo=2 is not allowed: model has no key 'foo'"),
    (["+model.dpeth=3"], "model.dpeth=3 is not allowed: model has no key 'dpeth'; did you mean depth?"),
    (["+sweep.params.x=1"], "+sweep.params.x=1 is not allowed: sweep is null here; choose one first with sweep=NAME"),
    (["model.foo=1"], "model.foo=1 is not allowed: model has no key 'foo'; its keys are name, depth"),
    (["model.heads=4"], "model.heads=4 is not allowed: model has no key 'heads'; did you mean "),
    (["foo=1"], "foo=1 is not allowed: the config has no key 'foo'"),
    (["optim.lr=0.1"], "optim.lr=0.1 is not allowed: optim has no key 'lr'"),
    (["hydra.foo=1"], "hydra.foo=1 is not allowed: hydra has no key 'foo'"),
    (["model.depth.x=1"], "model.depth.x=1 is not allowed: model.depth is a single value, not a group of keys"),
    (["sweep.n_trials=3"], "sweep.n_trials=3 is not allowed: sweep is null here; choose one first with sweep=NAME"),
    (["+model=tiny"], "+model=tiny is not allowed: model is chosen already; write model=tiny without +"),
    (["+model.depth=3"], "+model.depth=3 is not allowed: model.depth exists already; set it without +"),
    # options of a config group
    (["model=huge"], f"model=huge is not allowed: model has no such option; choose one of {MODELS}"),
    (["optim=sgd"], "optim=sgd is not allowed: optim has no such option; choose one of adamw, muon"),
    (["schedule=linear"], "schedule=linear is not allowed: schedule has no such option; choose one of constant"),
    (["kernel=cudnn"], "kernel=cudnn is not allowed: kernel has no such option; choose one of compiled"),
    (["budget=phase9"], "budget=phase9 is not allowed: budget has no such option; choose one of phase1"),
    (["data=nope"], "data=nope is not allowed: data has no such option; choose one of climbmix"),
    (["sweep=nope"], "sweep=nope is not allowed: sweep has no such option; choose one of arch"),
    (["model=[a]"], f"model=[a] is not allowed: model has no such option; choose one of {MODELS}"),
    (["hydra/sweeper=nope"], "hydra/sweeper=nope is not allowed: hydra/sweeper has no such option"),
    (["--multirun", "sweep=lr", "hydra/sweeper=basic"],
     "hydra/sweeper=basic is not allowed with sweep=lr: only the frontier sweeper"),
    # values of the wrong type
    (["model.depth=abc"], "model.depth=abc is not allowed: must be an integer"),
    (["model.depth=1.5"], "model.depth=1.5 is not allowed: must be an integer"),
    (["model.depth="], "model.depth= is not allowed: must be an integer"),
    (["train.batch_tokens=1.5"], "train.batch_tokens=1.5 is not allowed: must be an integer"),
    (["model.rope_base=abc"], "model.rope_base=abc is not allowed: must be a number"),
    (["model.softcap=abc"], "model.softcap=abc is not allowed: must be a number or null"),
    (["tracking.enabled=maybe"], "tracking.enabled=maybe is not allowed: must be true or false"),
    (["model.value_embed_layers=[a]"], "model.value_embed_layers=[a] is not allowed: must be a list of integers"),
    (["optim.adam_betas=[0.9,x]"], "optim.adam_betas=[0.9,x] is not allowed: must be a list of numbers"),
    (["seed=abc"], "seed=abc is not allowed: must be an integer"),
    (["eval.core_max_per_task=0"], "eval.core_max_per_task=0 is not allowed: a positive number of items per task"),
    (["eval.core_max_per_task=-1"], "eval.core_max_per_task=-1 is not allowed: a positive number of items"),
    (["eval.final_tokens=0"], "eval.final_tokens=0 is not allowed: must be positive, or null to size it"),
    (["neuron_logical_cores=two"], "neuron_logical_cores=two is not allowed: must be an integer or null"),
    # what Hydra's override grammar cannot read
    (["model.depth==3"], "'model.depth==3' is not allowed: it is not an override Hydra can read"),
    (["model.depth"], "'model.depth' is not allowed: an override is KEY=VALUE"),
    (["model.value_embed_layers=[1,2"], "'model.value_embed_layers=[1,2' is not allowed: it is not an override"),
    (["=3"], "'=3' is not allowed: it is not an override Hydra can read"),
    (["model.depth=3)"], "'model.depth=3)' is not allowed: it is not an override Hydra can read"),
    (["--no-such-flag"], "--no-such-flag is not allowed: not an option of this command"),
    (["--multirun", "--cfg", "job"], "--multirun and --cfg are not allowed together"),
    # Hydra's own flags: it printed a traceback or its own line with exit code 1
    (["--cfg", "job", "--package=nope"], "--package=nope is not allowed: the job config has no such key"),
    (["--experimental-rerun=/nonexistent.pickle"], "--experimental-rerun=/nonexistent.pickle is not allowed: it is "
                                                   "not a file"),
    (["--shell-completion"], "--shell-completion is not allowed alone: add install=SHELL"),
    (["--resolve"], "--resolve is not allowed alone: it goes with --cfg or --help"),
    (["--config-name=nosuch"], "--config-name=nosuch is not allowed: there is no such primary config; choose one "
                                  "of config"),
    (["--config-name=nosuch", "--help"], "--config-name=nosuch is not allowed: there is no such primary config"),
    (["--config-path=/nonexistent"], "--config-path=/nonexistent is not allowed: no config is there"),
    (["hydra.searchpath=[file:///nonexistent]"], "hydra.searchpath=[file:///nonexistent] is not allowed: /nonexistent "
                                                 "is not there (an entry is a folder"),
    # a sweep without --multirun
    (["model=tiny,base"], "model=tiny,base is not allowed: a comma list or sweep function sweeps over values, "
                          "which needs --multirun"),
    (["model.depth=range(1,3)"], "model.depth=range(1,3) is not allowed: a comma list or sweep function"),
    # deleting what the schema needs
    (["~model"], f"~model is not allowed: model is required; choose one of {MODELS}"),
    (["~data"], "~data is not allowed: data is required; choose one of climbmix"),
    (["~model.depth"], "~model.depth is not allowed: model.depth is part of the schema and cannot be deleted"),
    (["~foo"], "~foo is not allowed: the config has no key 'foo'"),
    # interpolations that do not resolve
    (["seed=${foo}"], "seed=${foo} is not allowed: Interpolation key 'foo' not found"),
    (["precision=${oc.env:FRONTIER_NO_SUCH_VARIABLE}"], "precision=${oc.env:FRONTIER_NO_SUCH_VARIABLE} is not "
                                                        "allowed: "),
    (["model.depth=${data.path}"], "model.depth=${data.path} is not allowed: must be an integer"),
    # numbers out of range, and non-finite numbers anywhere
    (["optim.embedding_lr=inf"], "optim.embedding_lr=inf is not allowed: numbers must be finite"),
    (["optim.matrix_lr=nan"], "optim.matrix_lr=nan is not allowed: numbers must be finite"),
    (["model.rope_base=-inf"], "model.rope_base=-inf is not allowed: numbers must be finite"),
    (["optim.adam_betas=[0.9,inf]"], "optim.adam_betas=[0.9, inf] is not allowed: numbers must be finite"),
    (["budget.seconds=inf"], "budget.seconds=inf is not allowed: numbers must be finite"),
    (["seed=-1"], "seed=-1 is not allowed: an integer in 0 ... 4294967295"),
    (["seed=4294967296"], "seed=4294967296 is not allowed: an integer in 0 ... 4294967295"),
    (["model.depth=-1"], "model.depth=-1 is not allowed: must be a positive integer"),
    (["schedule.warmdown_fraction=1.5"], "schedule.warmdown_fraction=1.5 is not allowed: must be between 0 and 1"),
    (["model.n_head=3"], "model.d_model=128 is not allowed: must be divisible by model.n_head=3"),
    (["train.batch_tokens=1000"], "train.batch_tokens=1000 is not allowed: must be a multiple of model.seq_len=256"),
    (["data.path="], "data.path='' is not allowed: set it to a directory or file of text"),
    (["data.path=/no/such/folder"], "data.path='/no/such/folder' does not exist"),
    (["data.path=README.md"], "data.path='README.md' is not allowed: README.md is not a data file"),
    (["precision=fp8"], "precision='fp8' is not allowed: choose one of auto, bf16, fp32"),
    (["neuron_logical_cores=3"], "neuron_logical_cores=3 is not allowed: 1 (8 logical cores per Trainium2 chip)"),
    (["device=tpu"], "device='tpu' is not allowed: choose one of auto, cpu, cuda, cuda:N, neuron"),
    (["device=cpu:abc"], "device='cpu:abc' is not allowed: choose one of auto, cpu, cuda, cuda:N, neuron"),
    (["device=auto:1"], "device='auto:1' is not allowed: choose one of auto, cpu, cuda, cuda:N, neuron"),
    (["kernel=compiled", "kernel.compile_mode=foo"], "kernel.compile_mode='foo' is not allowed: choose one of "
                                                     "default, reduce-overhead, max-autotune"),
    (["data.cache_dir="], "data.cache_dir='' is not allowed: set it to a directory for caches"),
    (["hydra.run.dir="], "hydra.run.dir='' is not allowed: set it to a directory for Hydra's outputs"),
    (["--multirun", "hydra.sweep.dir="], "hydra.sweep.dir='' is not allowed: set it to a directory for Hydra's "
                                         "outputs"),
    (["hydra.run.dir=${nope}"], "hydra.run.dir=${nope} is not allowed: Interpolation key 'nope' not found"),
    (["--multirun", "hydra.sweep.dir=out/${nope.x}"], "hydra.sweep.dir=out/${nope.x} is not allowed: Interpolation "
                                                      "key 'nope.x' not found"),
    (["hydra.run.dir=out/${oc.env:FRONTIER_NO_SUCH_VARIABLE}"], "hydra.run.dir=out/${oc.env:FRONTIER_NO_SUCH_"
                                                                 "VARIABLE} is not allowed: KeyError raised while "
                                                                 "resolving interpolation: \"Environment variable"),
    (["hydra.job.name=${nope}"], "hydra.job.name=${nope} is not allowed: Interpolation key 'nope' not found"),
    (["hydra.output_subdir=${nope}"], "hydra.output_subdir=${nope} is not allowed: Interpolation key 'nope'"),
    (["--multirun", "model.depth=2,3", "hydra.sweep.subdir=${nope}"], "hydra.sweep.subdir=${nope} is not allowed: "
                                                                      "Interpolation key 'nope' not found"),
    (["data.tokenizer_path=README.md"], "data.tokenizer_path='README.md' is not allowed: README.md is not a "
                                        "tokenizer.json the tokenizers library can read"),
    (["data.tokenizer_path=/no/such/tokenizer.json"], "data.tokenizer_path='/no/such/tokenizer.json' is not "
                                                      "allowed: /no/such/tokenizer.json is not a file"),
    (["tracking.uri=sqlite://"], "tracking.uri='sqlite://' is not allowed: an in-memory database ends with the "
                                 "process"),
    (["--multirun", "sweep=lr", "sweep.storage=sqlite://"], "sweep.storage='sqlite://' is not allowed: an in-memory "
                                                            "database ends with the driver"),
    (["--multirun", "sweep=lr", "sweep.name="], "sweep.name='' is not allowed: name the sweep"),
    (["tracking.uri=sqlite:///:memory:"], "tracking.uri='sqlite:///:memory:' is not allowed: an in-memory "
                                          "database ends with the process"),
    (["optim.name=sgd"], "optim.name='sgd' is not allowed: choose one of muon, adamw"),
    (["model.activation=tanh"], "model.activation='tanh' is not allowed: choose one of relu2"),
    (["kernel.attention=cudnn"], "kernel.attention='cudnn' is not allowed: choose one of reference, triton, nki"),
    (["eval.every_fraction=2"], "eval.every_fraction=2.0 is not allowed: must be between 0 and 1"),
    (["budget.seconds=0"], "budget.seconds=0.0 is not allowed: must be positive"),
    (["data.vocab_size=100"], "data.vocab_size=100 is not allowed: between 260"),
    (["tracking.experiment="], "tracking.experiment='' is not allowed: name an MLflow experiment"),
    # --multirun: every point of a grid is checked before the first runs
    (["--multirun", "sweep.n_trials=3", "sweep=lr", "model.depth=abc"], "model.depth=abc is not allowed: must be an "
                                                                        "integer"),
    (["--multirun", "model=tiny,huge"], f"model=huge is not allowed: model has no such option; choose one of {MODELS}"),
    (["--multirun", "model.depth=2,abc"], "model.depth=abc is not allowed: must be an integer"),
    (["--multirun", "model.depth=2,-1"], "model.depth=-1 is not allowed: must be a positive integer"),
    (["--multirun", "seed=1,-1"], "seed=-1 is not allowed: an integer in 0 ... 4294967295"),
    (["--multirun", "+foo=1,2"], "foo=1 is not allowed: the config has no key 'foo'"),
    (["--multirun", "optim.matrix_lr=interval(0.01,0.1)"], "optim.matrix_lr=interval(0.01,0.1) is not allowed: a "
                                                           "--multirun grid takes lists of values"),
    (["--multirun", "model.depth=2,3", "model.n_head=3"], "model.d_model=128 is not allowed: must be divisible"),
    (["--multirun", "hydra.run.dir=a,b"], "hydra.run.dir=a,b is not allowed: "),
    (["--multirun", "seed=1,2", "model.depth=range(1,1000000)"], "model.depth=range(1,1000000) is not allowed: the "
                                                                 "--multirun grid would launch 1,999,998 runs, more"),
    # --multirun sweep=NAME: the search's settings
    (["--multirun", "sweep=nope"], "sweep=nope is not allowed: sweep has no such option; choose one of arch"),
    (["--multirun", "sweep=lr", "sweep.sampler=foo"], "sweep.sampler='foo' is not allowed: choose one of tpe"),
    (["--multirun", "sweep=lr", "sweep.n_trials=0"], "sweep.n_trials=0 is not allowed: a positive integer or null"),
    (["--multirun", "sweep=lr", "sweep.study_name="], "sweep.study_name='' is not allowed: name a study, or leave it"),
    (["--multirun", "sweep=lr", "sweep.seed=-1"], "sweep.seed=-1 is not allowed: an integer in 0 ... 4294967295"),
    (["--multirun", "sweep=lr", "sweep.min_relative_speed=0"], "sweep.min_relative_speed=0.0 is not allowed: a "
                                                                "fraction in (0, 1] of the median speed"),
    (["--multirun", "sweep=lr", "sweep.min_relative_speed=1.5"], "sweep.min_relative_speed=1.5 is not allowed: a "
                                                                  "fraction in (0, 1]"),
    (["--multirun", "sweep=lr", "sweep.n_jobs=abc"], "sweep.n_jobs=abc is not allowed: must be an integer"),
    (["--multirun", "sweep=lr", "+sweep.foo=1"], "sweep.foo=1 is not allowed: sweep has no key 'foo'"),
    (["--multirun", "sweep=lr", "optim.embedding_lr=inf"], "optim.embedding_lr=inf is not allowed: numbers must be "
                                                           "finite"),
    (["--multirun", "sweep=lr", "sweep.params.optim.matrix_lr=foo(1)"], "'sweep.params.optim.matrix_lr=foo(1)' is "
                                                                       "not allowed: it is not an override"),
    (["--multirun", "sweep=lr", "sweep.n_jobs=999"], "sweep.n_jobs=999 is not allowed: this machine has"),
    (["--multirun", "sweep=lr", "model.depth=range(4,4)"], "'model.depth=range(4,4)' is not a valid search space "
                                                           "(the range holds no values)"),
    (["--multirun", "sweep=lr", "optim.matrix_lr=tag(lgo, interval(0.01,0.1))"],
     "'optim.matrix_lr=tag(lgo, interval(0.01,0.1))' is not a valid search space (unknown tag 'lgo'; the one "
     "tag is log, on an interval)"),
    (["--multirun", "sweep=lr", "model.depth=tag(log, choice(2,4))"], "'model.depth=tag(log, choice(2,4))' is "
                                                                     "not a valid search space (tag(log, ...) applies"),
    (["--multirun", "sweep=lr", "model=glob(*)"], "'model=glob(*)' is not a valid search space (glob(...) is not a "
                                                  "search space: name the options with choice(...))"),
    (["--multirun", "sweep=lr", "sweep.storage=://x"], "sweep.storage='://x' is not reachable"),
    (["--multirun", "sweep=lr", "data.path=/no/such/folder"], "data.path='/no/such/folder' does not exist"),
    (["--multirun", "sweep=lr", "model.depth=range(-4,-2)"], "model.depth=-4 is not allowed: must be a positive "
                                                             "integer, in a trial of this search (model=tiny"),
    (["--multirun", "sweep=lr", "schedule.warmdown_fraction=interval(0.5,1.5)"],
     "schedule.warmdown_fraction=1.5 is not allowed: must be between 0 and 1, in a trial of this search"),
    # --multirun sweep=frontier: the family of shapes, its budgets
    (["--multirun", "sweep=frontier", "sweep.frontier.depths=[2,4]"], "sweep.frontier.depths=[2, 4] is not allowed: "
                                                                     "at least three distinct positive depths"),
    (["--multirun", "sweep=frontier", "sweep.budgets=[0]"], "sweep.budgets=[0.0] is not allowed: distinct positive "
                                                           "seconds"),
    (["--multirun", "sweep=frontier", "sweep.budgets=[60,240]", "sweep.pruner=hyperband"],
     "sweep.pruner='hyperband' is not allowed: none with several sweep.budgets=[60.0, 240.0]"),
    (["--multirun", "sweep=frontier", "sweep.budgets=[60,240]", "sweep.confirm=3"],
     "sweep.confirm=3 is not allowed with several sweep.budgets"),
    (["--multirun", "sweep=frontier", "sweep.frontier.aspect_ratio=8192", "sweep.frontier.depths=[2,4,64]"],
     "sweep.frontier.depths=[2, 4, 64] is not allowed on this cpu: depth 64 ("),
    (["--multirun", "sweep=frontier", "model.depth=choice(2,4)"], "model.depth is not allowed in this search space: "
                                                                 "sweep.frontier.depths sets it"),
    (["--multirun", "sweep=frontier", "sweep.frontier.lr_scales=[]"], "sweep.frontier.lr_scales=[] is not allowed"),
    (["--multirun", "sweep=frontier", "sweep.validate=1"], "sweep.validate=1 is not allowed: 0 (off), or at least 2 "
                                                          "seeds"),
    (["--multirun", "sweep=lr", "sweep.validate=3"], "sweep.validate=3 is not allowed: 0 (off), or at least 2 seeds "
                                                     "(a comparison needs each shape's spread) on a frontier sweep"),
    (["optim.lr_scale=0"], "optim.lr_scale=0.0 is not allowed: must be positive"),
    # --multirun: a budget ladder's rungs and promotions
    (["--multirun", "sweep=ladder", "sweep.ladder=[120,30]"], "sweep.ladder=[120.0, 30.0] is not allowed: at least "
                                                               "two increasing positive budgets in seconds"),
    (["--multirun", "sweep=ladder", "sweep.ladder=[0,30]"], "sweep.ladder=[0.0, 30.0] is not allowed: at least two "
                                                             "increasing positive budgets"),
    (["--multirun", "sweep=ladder", "sweep.promote=1"], "sweep.promote=1.0 is not allowed: the share of a rung's "
                                                         "finished configurations that climbs, between 0 and 1"),
    (["--multirun", "sweep=ladder", "sweep.promote=0"], "sweep.promote=0.0 is not allowed: the share"),
    (["--multirun", "sweep=ladder", "sweep.budgets=[60]"], "sweep.budgets=[60.0] is not allowed: null with "
                                                            "sweep.ladder=[30.0, 120.0, 480.0]: the ladder sets"),
    (["--multirun", "sweep=frontier", "sweep.ladder=[30,120]"], "sweep.ladder=[30.0, 120.0] is not allowed: null in "
                                                                 "a frontier sweep"),
    (["--multirun", "sweep=ladder", "sweep.pruner=median"], "sweep.pruner='median' is not allowed: none with "
                                                             "sweep.ladder=[30.0, 120.0, 480.0]: a pruner compares"),
    (["--multirun", "sweep=ladder", "budget.seconds=choice(30,60)"], "budget.seconds is not allowed in this search "
                                                                      "space: sweep.ladder sets it"),
    # --multirun: confirmation's blocks and its equivalence margin
    (["--multirun", "sweep=lr", "sweep.confirm=4", "sweep.confirm_max=3"],
     "sweep.confirm_max=3 is not allowed: at least the 4 blocks confirmation starts with (sweep.confirm)"),
    (["--multirun", "sweep=lr", "sweep.confirm_max=2"],
     "sweep.confirm_max=2 is not allowed: at least the 3 blocks confirmation starts with"),
    (["--multirun", "sweep=lr", "sweep.equivalence=-0.001"],
     "sweep.equivalence=-0.001 is not allowed: a val_bpb difference >= 0"),
    # --multirun: a sweep's own settings are not swept
    (["--multirun", "sweep=lr,arch"], "sweep=lr,arch is not allowed: a sweep's own settings cannot be swept"),
    (["--multirun", "sweep=lr", "sweep.sampler=tpe,bogus"], "sweep.sampler=tpe,bogus is not allowed: a sweep's own "
                                                            "settings cannot be swept"),
    (["--multirun", "sweep=lr", "sweep.n_jobs=1,999"], "sweep.n_jobs=1,999 is not allowed: a sweep's own settings"),
    (["--multirun", "sweep=lr", "sweep.params.optim.matrix_lr=interval(0.01,0.1)"],
     "sweep.params.optim.matrix_lr=interval(0.01,0.1) is not allowed: a sweep's own settings cannot be swept"),
]


def isolated(folder) -> list[str]:
    """Every place a run writes to, inside `folder`."""
    return [f"hydra.run.dir={folder}/run", f"hydra.sweep.dir={folder}/sweep", "tracking.enabled=true",
            f"tracking.uri=sqlite:///{folder}/mlflow.db", f"data.cache_dir={folder}/cache"]


def bad_command_line(folder, args: list[str]) -> list[str]:
    """A row's mistake on the base command line, every place it could write inside `folder`."""
    options = [arg for arg in args if arg.startswith("--") or arg == "job"]  # before the overrides, as Hydra reads them
    overrides = [arg for arg in args if arg not in options]
    if {"sweep=lr", "sweep=frontier"} & set(overrides) and not any(o.startswith("sweep.storage=") for o in overrides):  # the study's too
        overrides.append(f"sweep.storage={folder}/study.journal")
    return [*options, *FAST, "budget.max_steps=1", *isolated(folder), *overrides]


@pytest.mark.parametrize("args, message", spread(BAD, [" ".join(args) for args, _ in BAD], every=6))
def test_a_bad_command_line_is_one_sentence_exit_2_and_writes_nothing(tmp_path, args, message):
    result = command_in_process("frontier.train", bad_command_line(tmp_path, args))
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_table_is_at_least_sixty_distinct_mistakes():
    assert len({" ".join(args) for args, _ in BAD}) == len(BAD) >= 60


@pytest.mark.parametrize("group, preset, message", [
    ("model", "defaults: [tiny, _self_]\nname: mine\ndepth: abc\n", "in its config model/mine, model.depth=abc must "
                                                                     "be an integer"),
    ("model", "defaults: [tiny, _self_]\nname: mine\ndpeth: 4\n", "in its config model/mine, model has no key "
                                                                   "'dpeth'; did you mean depth?"),
    ("model", "defaults: [tinyy, _self_]\nname: mine\n", "in its config model/mine, the defaults entry tinyy is not "
                                                         "there; model has base, d4, deep"),
    ("model", "name: mine\ndepth: [1, 2\n", "{conf}/model/mine.yaml is not valid YAML: line 3, column 1: expected "
                                          "',' or ']', but got '<stream end>' (while parsing a flow sequence from "
                                          "line 2, column 8)"),
    ("sweep", "name: mine\nparms:\n  optim.matrix_lr: interval(0.01, 0.1)\n", "in its config sweep/mine, sweep has "
                                                                             "no key 'parms'; did you mean params?"),
], ids=["bad value", "bad key", "a defaults entry not there", "not YAML", "bad key in a sweep preset"])
@pytest.mark.parametrize("via", ["--config-dir", "hydra.searchpath"])
def test_a_mistake_inside_a_users_preset_names_the_preset_the_key_and_the_value(tmp_path, group, preset, message, via):
    """A defaults entry not there had listed the preset itself as the choice; YAML that does not parse
    gave PyYAML's first line alone, without the file; a sweep preset's unknown key said "sweep is null"."""
    (tmp_path / "conf" / group).mkdir(parents=True)
    (tmp_path / "conf" / group / "mine.yaml").write_text(preset)
    (tmp_path / "out").mkdir()
    options, chosen = (["--multirun"], ["sweep=mine", f"sweep.storage={tmp_path}/out/study.journal"]) \
        if group == "sweep" else ([], ["model=mine"])
    if via == "--config-dir":
        options += ["--config-dir", str(tmp_path / "conf")]
    else:  # after the choice: Hydra applies a search path first, and so must the search for the culprit
        chosen.append(f"hydra.searchpath=[file://{tmp_path / 'conf'}]")
    result = command_in_process("frontier.train", [*options, *FAST, *isolated(tmp_path / "out"), *chosen])
    assert result.returncode == 2, result.stderr
    message = message.replace("{conf}", str(tmp_path / "conf"))
    assert result.stderr.startswith(f"error: {group}=mine is not allowed: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert list((tmp_path / "out").iterdir()) == []


def test_a_primary_config_of_ones_own_in_config_dir_is_shown_and_its_mistakes_named(tmp_path):
    """Hydra finds --config-name in --config-dir; so must the composition that explains a mistake Hydra refused."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\nseed: 7\n")
    (tmp_path / "out").mkdir()
    options = ["--config-dir", str(tmp_path / "conf"), "--config-name", "mine"]
    shown = command_in_process("frontier.train", [*options, "--cfg", "job", *FAST])
    assert shown.returncode == 0 and "seed: 7" in shown.stdout.splitlines(), shown.stderr
    refused = command_in_process("frontier.train", [*options, *FAST, *isolated(tmp_path / "out"), "model=huge"])
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(f"error: model=huge is not allowed: model has no such option; choose one of "
                                     f"{MODELS}") and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_an_unwritable_run_or_sweep_dir_is_refused_without_creating_anything(tmp_path):
    (tmp_path / "a_file").write_text("")
    for args in (["hydra.run.dir={}"], ["--multirun", "hydra.sweep.dir={}"]):
        target = tmp_path / "a_file" / "run"
        args = [arg.format(target) for arg in args]
        result = run_cli([*args[:-1], *FAST, args[-1]], timeout=120)
        assert result.returncode == 2, result.stderr
        key = args[-1].split("=")[0]
        assert result.stderr == f"error: {key}={target} is not allowed: it cannot be created (Not a directory); " \
                                f"{tmp_path / 'a_file'} is not a writable directory\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


STORE_CASES = [((args, store), f"{name}-{store}") for store in ("in a file", "not a database")
               for args, name in [([], "run"), (["--multirun", "sweep=lr"], "sweep"),
                                  (["--multirun", "sweep=lr", "tracking.required=false"], "sweep, not required")]]


@pytest.mark.parametrize("args, store", spread(*zip(*STORE_CASES), every=5))
def test_a_tracking_store_that_cannot_be_used_is_refused_before_anything_is_written(tmp_path, args, store):
    """A SQLite tracking.uri whose folder cannot be created, or that names a file that is not a database,
    was found only as the store was opened: by then Hydra had made the run directory (a FAILED run, 'not
    started'), and a sweep its sweep directory and its study (whose driver opens the store whatever
    tracking.required says)."""
    text = "a text file, not a database\n"
    (tmp_path / "a_file").write_text(text)
    db = tmp_path / "a_file" / "mlflow.db" if store == "in a file" else tmp_path / "a_file"
    uri = f"sqlite:///{db}"
    options, overrides = args[:1], args[1:]
    if overrides:
        overrides.append(f"sweep.storage={tmp_path}/study.journal")
    result = command_in_process("frontier.train", [*options, *FAST, "budget.max_steps=1", *isolated(tmp_path),
                                                   *overrides, f"tracking.uri={uri}"])
    assert result.returncode == 2, result.stderr
    problem = (f"its database cannot be created (Not a directory); {tmp_path / 'a_file'} is not a writable directory"
               if store == "in a file" else
               f"{db} is a file that is not a SQLite database; name the MLflow store, or a file that does not exist yet")
    assert result.stderr == f"error: tracking.uri={uri} is not allowed: {problem}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"] and (tmp_path / "a_file").read_text() == text


@pytest.mark.parametrize("args, message", [
    (["device=cuda"], "device='cuda' is not available: torch "),
    (["kernel=nki"], "the nki kernels (rmsnorm, relu2) cannot run here: "),
    (["eval.core=true", "eval.core_bundle={empty}"], "eval.core_bundle='{empty}' has no core.yaml"),
], ids=["device", "kernel", "core bundle"])
def test_what_this_machine_lacks_is_one_sentence_before_anything_is_written(tmp_path, args, message):
    """The device, the kernels and the CORE bundle are checked with the command line, before Hydra runs."""
    import torch

    if "device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, so device=cuda is not a mistake here")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    args = [arg.format(empty=empty) for arg in args]
    result = command_in_process("frontier.train", [*FAST, "budget.max_steps=1", *isolated(out), *args],
                                env={"NKI_SIMULATOR": "0"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message.format(empty=empty)}"), result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_a_trial_launched_into_a_study_that_is_not_there_is_one_sentence(tmp_path):
    """trial.* is what a sweep driver hands its trials; set by hand, a wrong one names its key."""
    import optuna

    from frontier.study import open_storage
    journal = tmp_path / "study.journal"
    optuna.create_study(study_name="lr", storage=open_storage(str(journal)))
    for args, message in [
        ([f"trial.storage={tmp_path / 'none.journal'}", "trial.study=lr"],
         f"trial.storage={tmp_path / 'none.journal'} does not exist: a trial joins the study its sweep driver"),
        ([f"trial.storage={journal}", "trial.study=nope"], f"trial.study='nope' is not a study in {journal}"),
        ([f"trial.storage={journal}", "trial.study=lr"], "trial.number=0 is not a trial of study 'lr'"),
    ]:
        result = run_cli([*FAST, "budget.max_steps=1", f"hydra.run.dir={tmp_path}/run", *args, "trial.number=0"],
                         timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines()[-1].startswith(f"error: {message}"), result.stderr
        assert "Traceback" not in result.stderr


def test_showing_commands_still_work():
    shown = run_cli(["model=tiny", "--cfg", "job"], timeout=120)
    assert shown.returncode == 0 and "name: tiny" in shown.stdout, shown.stderr
    # --cfg shows the config whatever this machine holds: what running needs (its data) is not checked
    elsewhere = run_cli(["model=tiny", "data.path=/nonexistent", "--cfg", "job"], timeout=120)
    assert elsewhere.returncode == 0 and "path: /nonexistent" in elsewhere.stdout, elsewhere.stderr
    for args in (["model.foo=1", "--cfg", "job"], ["model.depth=-1", "--cfg", "job"]):  # a config no run could take
        refused = run_cli([*args], timeout=120)
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {args[0]} is not allowed") \
            and len(refused.stderr.splitlines()) == 1, refused.stderr


OTHER_COMMANDS = [  # (module, arguments, what its one sentence names)
    ("frontier.eval", ["foo=1"], "foo=1 is not allowed: frontier.eval has no key 'foo'; its keys are checkpoint"),
    ("frontier.eval", ["chekpoint=x"], "chekpoint=x is not allowed: frontier.eval has no key 'chekpoint'; did you "
                                       "mean checkpoint?"),
    ("frontier.eval", ["checkpoint"], "'checkpoint' is not allowed: arguments are key=value"),
    ("frontier.eval", ["checkpoint=x", "core=maybe"], "core=maybe is not allowed: Value 'maybe' is not a valid bool"),
    ("frontier.model_card", ["model=nope"], "model=nope is not allowed: model has no such option; choose one of base"),
    ("frontier.model_card", ["model.depth=abc"], "model.depth=abc is not allowed: must be an integer"),
    ("frontier.leaderboard", ["foo=1"], "'foo'"),
    ("frontier.leaderboard", ["topp=5"], "topp=5 is not allowed: frontier.leaderboard has no key 'topp'; did you "
                                         "mean top?"),
    ("frontier.leaderboard", ["top=-1"], "top=-1 is not allowed: top must be a positive integer"),
    ("frontier.leaderboard", ["phase=3"], "phase=3 is not allowed: phase must be 1 or 2"),
    ("frontier.leaderboard", ["depth"], "'depth' is not allowed: arguments are key=value"),
    ("frontier.sweep_report", ["study=s", "foo=1"], "foo=1"),
    ("frontier.sweep_report", ["study=s", "storage=://x"], "storage='://x' is not reachable"),
    ("frontier.sweep_report", ["study="], "study= is not allowed: give the sweep's study name"),
    ("frontier.sweep_report", ["study=s", "storage=sqlite:////no/such/dir/optuna.db"],
     "storage='sqlite:////no/such/dir/optuna.db' is not allowed: it does not exist"),
    ("frontier.model_card", ["model.foo=1"], "'foo'"),
    ("frontier.model_card", ["--no-such-flag"], "--no-such-flag"),
    ("frontier.model_card", ["model=tiny", "--rows=-1"], "--rows=-1 is not allowed: it must be a positive integer"),
    ("frontier.model_card", ["model=tiny", "--steps=0"], "--steps=0 is not allowed: it must be a positive integer"),
    ("frontier.leaderboard", ["tracking.uri=sqlite:////no/such/dir/mlflow.db"],
     "tracking.uri=sqlite:////no/such/dir/mlflow.db is not allowed: there is no MLflow store there yet"),
]


@pytest.mark.parametrize("module, args, names", spread(OTHER_COMMANDS, [f"{m} {' '.join(a)}" for m, a, _ in OTHER_COMMANDS],
                                                      every=3))
def test_the_other_commands_refuse_an_unknown_key_in_one_sentence(module, args, names):
    result = command_in_process(module, args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], result.stderr


def test_a_sweep_report_of_a_sqlite_study_that_is_not_there_creates_no_database(tmp_path):
    database = tmp_path / "optuna.db"
    result = subprocess.run([sys.executable, "-m", "frontier.sweep_report", "study=s", f"storage=sqlite:///{database}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: storage='sqlite:///{database}' is not allowed: it does not exist; pass the " \
                            "sweep's sweep.storage\n"
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_report_out_that_cannot_be_created_is_one_sentence(tmp_path):
    import optuna

    from frontier.study import open_storage

    storage = tmp_path / "study.journal"
    optuna.create_study(study_name="s", storage=open_storage(str(storage)))
    (tmp_path / "a_file").write_text("")
    result = subprocess.run([sys.executable, "-m", "frontier.sweep_report", "study=s", f"storage={storage}",
                             f"out={tmp_path / 'a_file' / 'r'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: out={tmp_path / 'a_file' / 'r'} is not allowed: it cannot be created (Not a " \
                            f"directory); {tmp_path / 'a_file'} is not a writable directory\n"


def test_an_omegaconf_error_inside_the_task_is_a_bug_not_a_mistake_of_the_command_line():
    from omegaconf import OmegaConf

    from frontier.cli import is_mistake

    def task(cfg):
        return cfg.no_such_key

    errors = []
    for run in (lambda: task(OmegaConf.create({"a": 1}, flags={"struct": True})),
                lambda: OmegaConf.create({"a": 1}, flags={"struct": True}).no_such_key):
        try:
            run()
        except Exception as err:
            errors.append(err)
    assert [is_mistake(err, task, tuple) for err in errors] == [False, True]


def test_a_data_file_without_text_column_names_the_file(tmp_path):
    for s in range(2):
        pq.write_table(pa.table({"body": ["words"] * 3}), tmp_path / f"shard_{s:05d}.parquet")
    result = run_cli([*FAST, f"data.path={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert f"error: {tmp_path / 'shard_00000.parquet'} has no 'text' column" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("unreadable", ["a.txt", "b.txt"])  # the training split's file, the validation split's
def test_a_data_file_that_cannot_be_read_is_named_not_blamed_on_the_caches(tmp_path, unreadable):
    """/proc/self/mem is a regular file whose first read fails with EIO, as a failing disk's would."""
    data = tmp_path / "data"
    data.mkdir()
    text = (ROOT.parent / "shared" / "data" / "text" / "tinyshakespeare" / "input.txt").read_text()[:300_000]
    for name in ("a.txt", "b.txt"):
        if name == unreadable:
            (data / name).symlink_to("/proc/self/mem")
        else:
            (data / name).write_text(text)
    result = run_cli([*FAST, "data.vocab_size=512", "data.tokenizer_train_chars=100000", f"data.path={data}",
                      f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path}/run"], timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"error: cannot read {data / unreadable} (OSError: Input/output error)"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("err, named, expected", [
    (OSError("disk full\nmore detail"), True, "OSError: disk full"),
    (ValueError("\n\n  second line first  \n"), False, "second line first"),
    (EOFError(), True, "EOFError"),
    (EOFError(), False, "EOFError"),
    (RuntimeError("x" * 400), False, "x" * 297 + "..."),
])
def test_an_error_in_a_message_is_its_first_line(err, named, expected):
    from frontier.config import error_line
    assert error_line(err, named=named) == expected


def test_a_journal_on_a_read_only_disk_is_one_sentence(tmp_path):
    """An existing study there can be read, but the locks that count its trials go beside the journal."""
    import optuna

    disk = tmp_path / "ro"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        journal = disk / "j.log"
        optuna.create_study(study_name="lr", storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        result = run_cli(["--multirun", "sweep=lr", *FAST, f"sweep.storage={journal}",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: sweep.storage='{journal}' is not allowed: a journal's lock files are made beside it, and {disk} "
        "is not a writable directory (Read-only file system)"), result.stderr[-3000:]


LONG = "a" * 300  # longer than a file name may be (255 bytes)


REFUSED_PATHS = [  # (module, arguments, the key named, why)
    ("frontier.train", [*FAST, "budget.max_steps=1", "hydra.run.dir={tmp}/" + LONG], "hydra.run.dir", "File name too long"),
    ("frontier.train", [*FAST, "budget.max_steps=1", "data.path={tmp}/" + LONG], "data.path", "File name too long"),
    ("frontier.train", ["resume={tmp}/" + LONG], "resume", "File name too long"),
    ("frontier.train", [*FAST, "budget.max_steps=1", "hydra.run.dir={tmp}/loop/run"], "hydra.run.dir",
     "Too many levels of symbolic links"),
    ("frontier.train", [*FAST, "budget.max_steps=1", "data.path={tmp}/loop/data"], "data.path",
     "Too many levels of symbolic links"),
    ("frontier.train", [*FAST, "model.depth=" + "9" * 5000], "model.depth", "Exceeds the limit (4300 digits)"),
    ("frontier.eval", ["checkpoint={tmp}/" + LONG], "checkpoint", "File name too long"),
    ("frontier.sweep_report", ["study=s", "storage={tmp}/" + LONG + ".journal"], "storage", "File name too long"),
    ("frontier.leaderboard", ["tracking.uri=sqlite:///{tmp}/" + LONG + ".db"], "tracking.uri", "File name too long"),
    ("frontier.tracking", ["sync", "{tmp}/" + LONG], "{tmp}/", "File name too long"),
    ("frontier.bench", ["--multirun"], "--multirun", "frontier.bench takes bench.KEY=VALUE and trainer overrides only"),
    ("frontier.bench", ["bench.steps=0"], "bench.steps", "must be at least 1"),
    ("frontier.bench", ["bench.steps=abc"], "bench.steps=abc is not allowed", "Value 'abc' of type 'str' could not"),
    ("frontier.bench", ["bench.output={tmp}/file/bench.json"], "bench.output", "its folder cannot be created"),
    ("frontier.bench", ["bench.output={tmp}"], "bench.output", "it is a folder; name the JSON file to write"),
    ("frontier.bench", ["bench.results={tmp}/file/results.jsonl"], "bench.results", "its folder cannot be created"),
    ("frontier.bench", ["bench.results={tmp}"], "bench.results", "it is a folder; name the JSON-lines file"),
]
REFUSED_PATH_IDS = ["run dir too long", "data.path too long", "resume too long", "run dir in a symlink loop",
        "data.path in a symlink loop", "a 5000-digit integer", "eval", "sweep_report", "leaderboard", "sync",
        "bench --multirun", "bench.steps=0", "bench.steps=abc", "bench.output under a file", "bench.output a folder",
        "bench.results under a file", "bench.results a folder"]


@pytest.mark.parametrize("module, args, key, reason", spread(REFUSED_PATHS, REFUSED_PATH_IDS, every=3))
def test_a_path_the_os_refuses_or_a_value_out_of_bounds_is_one_sentence_exit_2(tmp_path, module, args, key, reason):
    """A name too long, a symlink loop, a number Python will not read: wherever the path is first touched
    (a check, Hydra's set-up, pathlib) it had been a traceback; and frontier.bench read Hydra's options
    as overrides and failed deep inside."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    result = command_in_process(module, args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(f"error: {key.replace('{tmp}', str(tmp_path))}") and reason in lines[-1], lines


ALONE = ([("frontier.train", bad_command_line("{tmp}", args), " ".join(args)) for args, _ in BAD[::12]]
         + [(module, args, f"{module} {' '.join(args)}") for module, args, _ in OTHER_COMMANDS[::4]]
         + [(module, args, f"{module} {name}") for (module, args, _, _), name in zip(REFUSED_PATHS[::5],
                                                                                   REFUSED_PATH_IDS[::5])])


@pytest.mark.parametrize("module, args", [row[:2] for row in ALONE], ids=[row[2] for row in ALONE])
def test_a_refused_command_says_the_same_from_a_process_of_its_own(tmp_path, module, args):
    """The tables' spread as separate `python -m` processes: the same exit code and sentence as in the
    test's process, nothing written, and no traceback from a module's import that a process does afresh."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # what the rows of REFUSED_PATHS name
    (tmp_path / "file").write_text("")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    alone = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "loop"]
    here = command_in_process(module, args)
    assert alone.returncode == here.returncode == 2, alone.stderr
    assert alone.stderr == here.stderr and len(alone.stderr.splitlines()) == 1, (alone.stderr, here.stderr)


@pytest.mark.parametrize("module, args, usage", [
    ("frontier.eval", ["--help"], "python -m frontier.eval checkpoint=PATH | run_id=ID"),
    ("frontier.leaderboard", ["-h"], "python -m frontier.leaderboard [experiment=frontier]"),
    ("frontier.sweep_report", ["study=s", "--help"], "python -m frontier.sweep_report study=NAME"),
    ("frontier.tracking", ["sync", "--help"], "usage: python -m frontier.tracking sync RUN_DIR"),
    ("frontier.bench", ["--help"], "bench keys: models=[tiny]"),
    ("frontier.val_spread", ["-h"], "python -m frontier.val_spread RUN_DIR ... [documents=800]"),
])
def test_a_side_command_s_help_is_its_usage_and_exit_0(module, args, usage):
    """--help had been refused as an argument that is not key=value, with exit code 2."""
    result = command_in_process(module, args)
    assert result.returncode == 0 and result.stderr == "" and usage in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("setting, reason", [
    ("hydra.job_logging.root.level=NOPE", "Unable to configure root logger (ValueError: Unknown level: 'NOPE')"),
    ("hydra.job_logging.handlers.file.filename={tmp}/file/x.log", "Unable to configure handler 'file'"),
    ("hydra.output_subdir={tmp}/file/x", "hydra.output_subdir={tmp}/file/x is not allowed: Not a directory"),
], ids=["a level that is none", "a log file under a file", "output_subdir under a file"])
def test_what_hydra_s_own_set_up_refuses_is_one_sentence_exit_2(tmp_path, setting, reason):
    (tmp_path / "file").write_text("")
    setting, reason = setting.replace("{tmp}", str(tmp_path)), reason.replace("{tmp}", str(tmp_path))
    result = run_cli([*FAST, "budget.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}", setting], timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith("error: ") and reason in result.stderr, result.stderr
