"""`python -m oppo_lab.convergence`: as `python -m oppo_lab convergence`."""

from oppo_lab.convergence.cli import main

raise SystemExit(main())
