import sys

from jax_ep.bench import main

sys.exit(main())
