"""The demo's scenarios, one module each (its config, its run, its tables and its figure):
``main_job`` (``ess-patch demo``), ``mixed`` (``--scenario mixed``, also ``ess_patch.demo.run``),
``collapse``, ``stress`` and ``weights``. The CLI's table of runners is
``ess_patch.cli_scenarios.SCENARIOS``."""
