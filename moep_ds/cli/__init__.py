"""The console commands, one module each (setup.py's console_scripts): moep-pretrain (pretrain), moep-prepare
(prepare), moep-eval (eval), moep-export (export), moep-generate (generate), moep-analyze (analyze), moep-import
(import_model), moep-convert (convert). Flags are spelled with underscores (`--batch_size`); each is accepted with
dashes too (`--batch-size`). How a command runs on every rank (one-line errors) is moep_ds/distributed/commands.py."""
