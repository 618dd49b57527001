from anyseek.cli import main

raise SystemExit(main())
