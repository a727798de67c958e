"""Research probes: one-off measurements behind the design notes, not installed by `pip install`.

Run them from the repository root (`python -m research.<probe>`); research/README.md says what
each one answered and where its result is written up."""
