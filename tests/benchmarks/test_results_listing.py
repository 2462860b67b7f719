"""Every result is listed and every script sits where its page does: docs/results/<topic>/README.md names every file
under its folder (benchmarks/results_tables.py writes the tables), and each script of benchmarks/ lives in the folder
of the topic its results go to."""

from pathlib import Path

from benchmarks import results_tables

REPO = Path(__file__).resolve().parents[2]


def test_every_topic_readme_is_up_to_date_and_lists_every_file(capsys):
    assert results_tables.main(["--check"]) == 0, capsys.readouterr().out
    for topic in results_tables.TOPICS:
        readme = (results_tables.ROOT / topic / "README.md").read_text()
        for path in (results_tables.ROOT / topic).rglob("*"):
            if path.is_file() and path.name != "README.md":
                assert f"]({path.relative_to(results_tables.ROOT / topic).as_posix()})" in readme, path


def test_a_file_in_a_subfolder_is_listed(tmp_path, monkeypatch):
    (tmp_path / "simulation" / "run_trace").mkdir(parents=True)
    (tmp_path / "simulation" / "run.json").write_text('{"command": "adaflash bench simulate", "rows": []}')
    (tmp_path / "simulation" / "run_trace" / "traces.jsonl").write_text("{}\n")
    monkeypatch.setattr(results_tables, "ROOT", tmp_path)
    files = " ".join(row["files"] for row in results_tables.rows_for(tmp_path / "simulation"))
    assert "(run_trace/traces.jsonl)" in files and "(run.json)" in files


def test_every_script_sits_in_its_topic_folder():
    scripts = [p for p in (REPO / "benchmarks").rglob("*.py") if p.name != "__init__.py"]
    loose = [p.name for p in scripts if p.parent == REPO / "benchmarks" and p.name != "results_tables.py"]
    assert not loose, f"place these in benchmarks/<topic>/ ({', '.join(results_tables.TOPICS)}): {loose}"
    assert {p.parent.name for p in scripts if p.parent != REPO / "benchmarks"} <= set(results_tables.TOPICS)
    assert not list((REPO / "docs" / "results").rglob("*.py")), "scripts live in benchmarks/<topic>/, results in docs/"
