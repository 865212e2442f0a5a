"""`python -m oppo_lab.convergence`: as `openrlhf-oppo bench convergence`."""

from oppo_lab.convergence.cli import main

raise SystemExit(main())
