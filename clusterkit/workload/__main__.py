from clusterkit.workload.main import main

raise SystemExit(main())
