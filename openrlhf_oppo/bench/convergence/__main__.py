"""`python -m openrlhf_oppo.bench.convergence`: as `openrlhf-oppo bench convergence`."""

from openrlhf_oppo.bench.convergence.cli import main

raise SystemExit(main())
