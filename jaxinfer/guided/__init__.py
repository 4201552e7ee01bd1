"""Structured output: a request's `guided` constraint (spec.py), compiled by outlines-core into a
token automaton (automaton.py, compiler.py) whose tables the step applies on the device
(engine/guide_tables.py). docs/guided.md says what each kind accepts and how it is enforced."""
