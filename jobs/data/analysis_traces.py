"""Generated data-analysis agent sessions with planted facts: the retention benchmark's second agent domain.

A session: the system prompt of an analysis agent with SQL and Python tools, the user's question
with one requirement, then tool calls that describe tables, preview rows, count values and run
aggregations (result tables), assistant notes between them, a follow-up request of the user in
the middle, and the agent's conclusion. Six facts of other kinds than the coding traces' are
planted once each: the user's requirement and follow-up (user messages), the query that answers
the question (a tool call), a metric (a tool result's number), an anomaly the agent explains
(assistant prose, a date) and the conclusion (assistant prose). Filler never spells them (checked).
Deterministic per seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from compaction.tokenizer import ChatTokenizer
from jobs.data.traces import CodingTrace, PlantedFact, Session, TokenCounter, check_planted, grow_until


@dataclass(frozen=True)
class Dataset:
    """One warehouse table the agent analyses, and the facts a session plants about it."""

    table: str
    purpose: str  # what the user wants to know
    columns: dict[str, str]  # column -> SQL type
    groups: tuple[str, ...]  # values of the grouping column (first column)
    requirement: str  # the user's requirement in the task: the `requirement` fact
    followup: str  # the user's mid-session request: the `followup` fact
    query: str  # the answering query: the `query` fact
    metric: tuple[str, str]  # (name, value): the `metric` fact is the value
    anomaly: tuple[str, str]  # (date, explanation): the `anomaly` fact is the date
    conclusion: str  # the `conclusion` fact


DATASETS: tuple[Dataset, ...] = (
    Dataset("orders", "how revenue per region developed this year",
            {"region": "text", "order_id": "bigint", "customer_id": "bigint", "net_amount": "numeric",
             "currency": "text", "status": "text", "ordered_at": "timestamp"},
            ("North", "South", "East", "West"),
            "report every amount in EUR", "leave out customers with fewer than two orders",
            "SELECT region, SUM(net_eur) AS revenue FROM orders_eur WHERE status <> 'refunded' GROUP BY region",
            ("median order value (EUR)", "41.37"), ("2023-11-24", "Black Friday, not a data error"),
            "the North region grew 12.4% year over year"),
    Dataset("sessions", "why the checkout conversion dropped last month",
            {"device": "text", "session_id": "uuid", "user_id": "bigint", "pages": "int",
             "duration_s": "int", "converted": "boolean", "started_at": "timestamp"},
            ("desktop", "mobile", "tablet", "app"),
            "count only sessions longer than ten seconds", "split the drop by browser version too",
            "SELECT device, AVG(converted::int) AS rate FROM sessions WHERE duration_s > 10 GROUP BY device",
            ("mobile conversion rate", "0.0187"), ("2023-09-14", "the payment page outage"),
            "the drop comes from mobile Safari after the 3DS change"),
    Dataset("readings", "which sensors drift out of calibration",
            {"site": "text", "sensor_id": "text", "value_c": "double", "reference_c": "double",
             "battery_v": "double", "read_at": "timestamp"},
            ("Aalen", "Brno", "Cork", "Delft"),
            "treat readings above 85 C as faulty, not as drift", "exclude the sensors replaced in March",
            "SELECT sensor_id, AVG(value_c - reference_c) AS bias FROM readings WHERE value_c <= 85 GROUP BY sensor_id",
            ("largest mean bias (C)", "2.914"), ("2023-06-02", "a firmware update that reset the offsets"),
            "sensor TX-0417 in Brno drifts by 0.3 C per month"),
)  # fmt: skip

QUESTIONS = {
    "requirement": "What requirement did the user set for the analysis?",
    "followup": "What did the user ask for later in the session?",
    "query": "Which query answers the user's question?",
    "metric": "What value did the key metric have?",
    "anomaly": "On which date was there an anomaly the agent explained?",
    "conclusion": "What did the agent conclude?",
}

SYSTEM = (
    "You are a data-analysis agent with read access to the warehouse schema analytics. You can call these tools:\n"
    "- describe_table(table): the columns and their types\n- run_sql(query): the result table (at most 20 rows)\n"
    "- run_python(code): run pandas code on the last result, returns what it prints\n"
    "- save_plot(path, kind): save a chart of the last result\n"
    "Answer with numbers from the data; state your assumptions."
)


class _Analysis(Session):
    """A session of one dataset; filler steps state no planted fact."""

    def __init__(self, rng: random.Random, data: Dataset) -> None:
        super().__init__(rng)
        self.data = data

    def table(self, header: list[str], rows: int) -> str:
        """A result table with filler numbers (integers and values with one decimal: never a planted one)."""
        lines = [" | ".join(header)]
        for _ in range(rows):
            group = self.rng.choice(self.data.groups)
            values = [str(self.rng.randint(10, 99_999)) if i % 2 == 0 else f"{self.rng.uniform(0, 999):.1f}"
                      for i in range(len(header) - 1)]  # fmt: skip
            lines.append(" | ".join([group, *values]))
        return "\n".join(lines)

    def sql(self) -> tuple[str, dict[str, Any], str]:
        cols = [c for c in self.data.columns if c != next(iter(self.data.columns))]
        a, b = self.rng.sample(cols, 2)
        group = next(iter(self.data.columns))
        query = f"SELECT {group}, COUNT(*) AS n, MAX({a}) AS top_{a} FROM {self.data.table} GROUP BY {group}"
        return "run_sql", {"query": query}, self.table([group, "n", f"top_{a}", f"distinct_{b}"], 4)

    def filler(self) -> None:
        rng, data = self.rng, self.data
        kind = rng.choice(["sql", "sql", "describe", "python", "plot", "note"])
        if kind == "sql":
            self.call(self.sql(), content=rng.choice([None, "Let me aggregate that per group."]))
        elif kind == "describe":
            schema = "\n".join(f"{c:<14} {t}" for c, t in data.columns.items())
            self.call(("describe_table", {"table": data.table}, f"table analytics.{data.table}\n{schema}"))
        elif kind == "python":
            col = rng.choice(list(data.columns))
            code = f"print(df['{col}'].describe())"
            out = "\n".join(f"{k:<6} {rng.uniform(0, 500):.1f}" for k in ("count", "mean", "std", "min", "max"))
            self.call(("run_python", {"code": code}, out))
        elif kind == "plot":
            path = f"plots/{data.table}_{rng.randint(1, 99)}.png"
            self.call(("save_plot", {"path": path, "kind": rng.choice(["bar", "line"])}, f"saved {path}"))
        else:
            a, b = rng.sample(list(data.columns), 2)
            self.say("assistant", f"The {a} column looks complete; next I compare it with {b} per group.")


def analysis_trace(seed: int = 0, target_tokens: int = 4_000, tokenizer: ChatTokenizer | None = None) -> CodingTrace:
    """A data-analysis session of about `target_tokens` tokens with six planted facts."""
    rng = random.Random(seed)
    data = rng.choice(DATASETS)
    s = _Analysis(rng, data)
    s.say("system", SYSTEM)
    count = TokenCounter(tokenizer, s.messages[0])
    planted: dict[str, tuple[str, int]] = {}
    task = f"I need to understand {data.purpose}, from analytics.{data.table}. Please {data.requirement}."
    planted["requirement"] = data.requirement, s.say("user", task)
    grow_until(s, count, int(0.2 * target_tokens))
    name, value = data.metric
    metric = ("run_python", {"code": f"print(summary[{name!r}])"}, f"{name}: {value}")
    planted["metric"] = value, s.call(metric, content="Now the key figure.") + 1
    grow_until(s, count, int(0.4 * target_tokens))
    planted["followup"] = data.followup, s.say("user", f"One more thing: {data.followup}.")
    grow_until(s, count, int(0.55 * target_tokens))
    planted["query"] = data.query, s.call(("run_sql", {"query": data.query}, s.table(["group", "value"], 4)))
    date, why = data.anomaly
    grow_until(s, count, int(0.7 * target_tokens))
    planted["anomaly"] = date, s.say("assistant", f"The spike on {date} is {why}; I keep those rows.")
    ending = [{"role": "assistant", "content": f"Conclusion: {data.conclusion}. The numbers are in the table above."}]
    grow_until(s, count, target_tokens - count.of(ending))
    planted["conclusion"] = data.conclusion, len(s.messages)
    s.messages += ending
    facts = [PlantedFact(kind, text, QUESTIONS[kind], i) for kind, (text, i) in planted.items()]
    check_planted(s.messages, facts)
    return CodingTrace(s.messages, sorted(facts, key=lambda f: f.message_index), seed)
