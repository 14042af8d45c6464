from clusterkit.cli.main import main

raise SystemExit(main())
