"""The fault-injection campaign and the benchmarks (``sdcwatch bench``): the machinery that scores
sdcwatch and the baselines on faulted training runs. Not in the base wheel: it is the
``sdcwatch-campaign`` distribution built from this folder (``pip install ./testbed/campaign``).

Its parts: :mod:`.run` (the campaign), :mod:`.fault_classes`, :mod:`.trials`, :mod:`.branches`
(a run from the checkpoint), :mod:`.impact` (the ground truth), :mod:`.scoring`, :mod:`.summary`,
:mod:`.targets`, :mod:`.guarded` (the guarded third way), :mod:`.clean_run` (false alarms on clean
training), :mod:`.fleet` (the host ledger across a simulated cluster's runs), :mod:`.baselines` and
:mod:`.cli` (``sdcwatch bench``).

Importing this package imports nothing: each part is imported where it is used.
"""

__all__: list[str] = []
