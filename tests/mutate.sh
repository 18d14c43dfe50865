#!/usr/bin/env bash
# Mutation testing (not in CI): mutmut mutates the modules that pyproject.toml's [tool.mutmut] names (the step
# protocol and agreement, stops, speculation, the prefill plan, sampling, the prefix cache, the calibration key,
# the split planners, the Hub file selection, calibrate's stage key, recovery's resume in serve/schedulers.py: pick
# their functions by name) and runs, for each mutant, the one-process tests that execute the
# mutated function. tests/README.md holds the score per module and the accepted survivors.
#
#   bash tests/mutate.sh                              # every module (hours on a 2-core machine)
#   bash tests/mutate.sh 'pipemlx.runtime.stops.*'    # one module (mutant names are module.function__mutmut_N)
#   MUTATE_CHILDREN=2 bash tests/mutate.sh ...        # more workers (default 1: it runs niced beside other work)
#   MUTATE_TESTS="tests/test_stops.py" bash tests/mutate.sh --survivors 'pipemlx.runtime.stops.*'
#                                                     # after adding tests: the survivors again, one pytest each
#   MUTATE_IN_PROCESS=1 ...  --survivors ...           # the same in one process (fast; not for import-time mutants)
#
# Afterwards: `mutmut show NAME` prints a mutant's diff, `mutmut results` lists the survivors; the score per
# module is printed at the end. The mutants/ folder caches results: delete it after changing the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import mutmut" 2>/dev/null || python -m pip install -q "mutmut>=3.8,<4"  # pipemlx[mutate]
export PYTHONPATH="$PWD" HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-mutate}"
if [ "${1:-}" = "--survivors" ]; then
    shift
    mapfile -t again < <(python tests/mutation_score.py --names "$@")
    # One plain pytest run per mutant, the current tests copied in (mutmut's own rerun would need its test map
    # collected again). MUTATE_TESTS: the test files to run (default: [tool.mutmut]'s selection).
    read -r -a tests <<< "${MUTATE_TESTS:-$(python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]))')}"
    [ "${#again[@]}" -eq 0 ] || nice -n 19 python tests/mutation_recheck.py "${tests[@]}" -- "${again[@]}"
else
    nice -n 19 mutmut run --max-children "${MUTATE_CHILDREN:-1}" "$@" || true
fi
python tests/mutation_score.py "$@"
