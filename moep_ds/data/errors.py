"""The one error type of the data pipeline."""
from moep_ds.errors import UserError


class DataError(UserError):
    """Unusable data input or a mismatch between prepared data and the run; the message is one line
    naming the offending path or field and its values. `moep-prepare` prints it as `error: <message>`."""
