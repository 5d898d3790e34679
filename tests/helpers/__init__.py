"""What the tests share and are not tests themselves: harnesses, fakes, models and assertions
(``from tests.helpers.moc_helpers import make``); the scripts the tests start as processes are in ``workers``."""
