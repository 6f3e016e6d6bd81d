"""A container kind defined outside ``vlmshard.preprocess``: tab-separated question and answer
lines, a row each. ``tests/test_formats.py`` names this module in ``VLMSHARD_READERS``, so every
process of the job registers it, as a user's own reader would be."""

from vlmshard.preprocess.containers import RowReader, SourceIndex
from vlmshard.preprocess.registry import register


class QuestionAnswerTsv(RowReader):
    kind, extension, description = "qa_tsv", ".tsv", "a .tsv of question<TAB>answer lines"

    def claims(self, path):
        return path.endswith(self.extension)

    def _lines(self, source):
        with open(source.path, encoding="utf-8") as f:
            return [line.rstrip("\n").split("\t") for line in f if line.strip()]

    def index(self, source):
        return SourceIndex(n_rows=len(self._lines(source)))

    def read_rows(self, source, part):
        lines = self._lines(source)
        for row in part.rows:
            question, answer = lines[row]
            yield int(row), {"messages": [{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}]}


register(QuestionAnswerTsv())
