import json
import math

import numpy as np
import pytest
import torch

from edurl import MetricsLogger, load_metrics
from edurl.utils import file_in_the_way


def test_log_writes_one_json_object_per_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, **{"env/all/reward/total": 0.5, "optim/entropy": torch.tensor(1.25)})
        logger.log(1, **{"env/all/reward/total": np.float32(0.75), "note": "ok", "count": np.int64(3)})
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 0 and first["env/all/reward/total"] == 0.5 and first["optim/entropy"] == 1.25
    assert first["time/total"] >= 0
    df = load_metrics(tmp_path)
    assert list(df["step"]) == [0, 1]
    assert df["env/all/reward/total"].tolist() == [0.5, 0.75]
    assert df["count"].iloc[1] == 3 and math.isnan(df["count"].iloc[0])  # missing metric becomes NaN


def test_nan_and_inf_round_trip(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, a=float("nan"), b=float("inf"), c=-float("inf"))
    row = load_metrics(tmp_path / "metrics.jsonl").iloc[0]
    assert math.isnan(row["a"]) and row["b"] == math.inf and row["c"] == -math.inf


def test_existing_file_is_not_overwritten_by_default(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, x=1.0)
    with pytest.raises(FileExistsError, match="if_exists='append'"):
        MetricsLogger(tmp_path)
    assert len(load_metrics(tmp_path)) == 1


def test_append_resumes_and_continues_wall_time(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, x=1.0, **{"time/total": 10.0})
    with MetricsLogger(tmp_path, if_exists="append") as logger:
        record = logger.log(1, x=2.0)
    df = load_metrics(tmp_path)
    assert df["x"].tolist() == [1.0, 2.0]
    assert record["time/total"] >= 10.0


def test_overwrite_replaces(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, x=1.0)
    with MetricsLogger(tmp_path, if_exists="overwrite") as logger:
        logger.log(5, x=9.0)
    assert load_metrics(tmp_path)["step"].tolist() == [5]


def test_bad_values_are_rejected_before_anything_is_written(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="tensor of shape \\(3,\\)"):
            logger.log(0, good=1.0, bad=torch.zeros(3))
        with pytest.raises(TypeError, match="metric 'bad' has type list"):
            logger.log(0, bad=[1, 2])
        with pytest.raises(TypeError, match="step must be an int"):
            logger.log(0.5, x=1.0)
        logger.log(1, x=1.0)
    assert load_metrics(tmp_path)["step"].tolist() == [1]


def test_bad_if_exists_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="if_exists"):
        MetricsLogger(tmp_path, if_exists="keep")
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        load_metrics(tmp_path / "nowhere")


def test_corrupt_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1,\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_metrics(tmp_path)


def test_truncate_keeps_earlier_steps_and_drops_a_cut_line(tmp_path):
    from edurl.metrics import truncate_metrics

    with MetricsLogger(tmp_path) as logger:
        for step in range(5):
            logger.log(step, x=float(step))
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "x": 5.')  # a write cut short by a kill
    assert truncate_metrics(tmp_path, before_step=3) == 3
    assert load_metrics(tmp_path)["step"].tolist() == [0, 1, 2]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    with MetricsLogger(tmp_path, if_exists="append") as logger:
        logger.log(3, x=3.0)
    assert load_metrics(tmp_path)["step"].tolist() == [0, 1, 2, 3]


def test_each_line_is_one_write(tmp_path, monkeypatch):
    # one unbuffered write() per line: a kill between writes can never leave half a line behind
    with MetricsLogger(tmp_path) as logger:
        writes = []
        real = logger._file.write
        monkeypatch.setattr(
            logger,
            "_file",
            type(
                "F",
                (),
                {"write": lambda self, b: writes.append(b) or real(b), "closed": False, "close": lambda self: None},
            )(),
        )
        logger.log(0, **{f"m{i}": float(i) for i in range(200)})
    assert len(writes) == 1 and writes[0].endswith(b"\n")


def test_truncate_names_a_line_that_is_not_a_record(tmp_path):
    # a resume used to stop on a bare JSONDecodeError or KeyError, with no file or line
    from edurl.metrics import truncate_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"x": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2, is not a metrics record with a 'step'"):
        truncate_metrics(tmp_path, 1)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        truncate_metrics(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text(encoding="utf-8") == '{"step": 0}\nnot json\n'  # left as it was


def test_load_metrics_on_a_folder_of_seeds_says_which_file_it_reads(tmp_path):
    """A run with num_seeds > 1 writes log_dir/seed{s}/metrics.jsonl; loading log_dir gave a bare 'no metrics file',
    or, where an earlier one-seed run had left log_dir/metrics.jsonl, that older run without a word."""
    import os

    import pytest

    for s in (3, 4):
        with MetricsLogger(tmp_path / f"seed{s}", if_exists="overwrite") as logger:
            logger.log(0, loss=float(s))
    with pytest.raises(FileNotFoundError, match="several seeds.*seed3, seed4.*seed3"):
        load_metrics(tmp_path)
    assert load_metrics(tmp_path / "seed4")["loss"].tolist() == [4.0]
    with MetricsLogger(tmp_path, if_exists="overwrite") as logger:
        logger.log(0, loss=-1.0)
    old = (tmp_path / "seed3" / "metrics.jsonl").stat().st_mtime - 100
    os.utime(tmp_path / "metrics.jsonl", (old, old))  # the one-seed run came first
    with pytest.warns(UserWarning, match="older than the seed folders"):
        assert load_metrics(tmp_path)["loss"].tolist() == [-1.0]
    later = old + 1000
    os.utime(tmp_path / "metrics.jsonl", (later, later))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_metrics(tmp_path)  # newer than the seed folders: no warning


def test_append_to_a_file_without_a_last_newline_starts_a_new_line(tmp_path):
    """'\\n'.join(json.dumps(r) ...) writes no last newline; appending joined two records on one line, which
    load_metrics then refused as invalid JSON."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1.0}', encoding="utf-8")
    with MetricsLogger(tmp_path, if_exists="append") as logger:
        logger.log(1, x=2.0)
    assert load_metrics(tmp_path)["x"].tolist() == [1.0, 2.0]


def test_a_line_that_is_json_but_not_a_record_is_named(tmp_path):
    for line in ("null", "3", "[1, 2]"):  # a TypeError inside pandas, or silently columns 0 and 1
        (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n' + line + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match="line 2 is JSON but not a record"):
            load_metrics(tmp_path)


def test_a_log_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        MetricsLogger(tmp_path / "taken")
    with pytest.raises(NotADirectoryError, match="'.*inner' lies under '.*taken', which is a file"):
        MetricsLogger(tmp_path / "taken" / "inner")  # was a bare "[Errno 20] Not a directory"
    assert file_in_the_way(tmp_path / "new" / "deeper") is None and file_in_the_way(tmp_path) is None


def test_truncate_metrics_names_a_step_that_is_not_an_int(tmp_path):
    from edurl.metrics import truncate_metrics

    with MetricsLogger(tmp_path, if_exists="overwrite") as logger:
        logger.log(0, loss=1.0)
    for bad in (None, "3", 2.5, True):  # None was "'<' not supported between instances of 'int' and 'NoneType'"
        with pytest.raises(ValueError, match="before_step must be the step"):
            truncate_metrics(tmp_path, bad)
    assert len(load_metrics(tmp_path)) == 1  # nothing lost
