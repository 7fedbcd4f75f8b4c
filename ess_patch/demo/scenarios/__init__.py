"""The demo's scenarios, one module each (its config, its run, its tables and its figure):
``main_job`` (``ess-patch demo``), ``collapse``, ``stress`` and ``weights``. The mixed scenario
is the demo's own ``run`` (``ess_patch.demo``). The CLI's table of runners is
``ess_patch.cli_scenarios.SCENARIOS``."""
