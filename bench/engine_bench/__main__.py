from bench.engine_bench.cli import main

raise SystemExit(main())
