# The two commands of the README: `make demo` runs the main job, `make test` the tests.
.PHONY: demo test bench

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

bench:
	.venv/bin/python bench/run.py --all --json
