"""The prompts ``benchmark_serving.py`` sends, by ``--prompt-set``: short and long chat
questions ("mixed" is both), and "copy", a file to rewrite with one change, where prompt
lookup helps. The same prompts in every run and tool, so that results compare."""

SHORT_PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List four animals that live in the Arctic.",
    "Give me a tip for learning to cook.",
    "What does a thermometer measure?",
    "Translate 'good morning' into Spanish.",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue? Answer briefly.",
    "Count from one to ten in words.",
    "Describe a bicycle to someone who has never seen one.",
)
_PASSAGE = (
    "The town library opened in 1904 with two hundred books donated by local families. Over the "
    "next century it moved three times, first to the old post office, then to a converted "
    "grain store by the river, and finally to a glass building beside the railway station. "
    "Today it lends books, tools, seeds and musical instruments, runs reading groups for "
    "children and adults, and offers free internet access. Volunteers repair donated laptops "
    "in a workshop on the ground floor, and the roof garden grows vegetables that are given "
    "away every Saturday morning."
)
LONG_PROMPTS = (
    f"Summarise this text in two sentences.\n\n{_PASSAGE}",
    f"Write three questions a student could answer from this text.\n\n{_PASSAGE}",
    f"List every place the library has been, in order.\n\n{_PASSAGE}",
    ("You are a travel guide. A visitor has one rainy afternoon in a small coastal town with a "
     "harbour, a museum of shipbuilding, a bakery famous for apple cake and a cliff-top walk. "
     "Plan the afternoon hour by hour and explain each choice."),
    ("Here is a shopping list: flour, eggs, milk, butter, sugar, apples, cinnamon, salt, lemons, "
     "yeast, rice, tomatoes, onions, garlic, olive oil and basil. Group the items by the aisle "
     "of a supermarket where they would be found, then suggest two dishes that use most of them."),
    ("A team of four must paint a fence of forty panels. Anna paints four panels an hour, Ben "
     "three, Chen five and Dina two, and they all start at nine o'clock. Explain step by step "
     "when the fence will be finished, and who should stop first if they want to share the work "
     "evenly."),
)
# A file of about 400 tokens to rewrite with one change: a copy, the work speculative
# decoding by prompt lookup speeds up (the output repeats long stretches of the prompt).
CODE_FILE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Account:
    owner: str
    balance: float = 0.0
    history: list[tuple[str, float]] = field(default_factory=list)

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("a deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("a withdrawal must be positive")
        if amount > self.balance:
            raise ValueError("not enough money in the account")
        self.balance -= amount
        self.history.append(("withdraw", amount))


def load_accounts(path: Path) -> dict[str, Account]:
    accounts = {}
    for row in json.loads(path.read_text()):
        account = Account(row["owner"], row["balance"])
        accounts[account.owner] = account
    return accounts


def save_accounts(path: Path, accounts: dict[str, Account]) -> None:
    rows = [{"owner": a.owner, "balance": a.balance} for a in accounts.values()]
    path.write_text(json.dumps(rows, indent=2))


def transfer(source: Account, target: Account, amount: float) -> None:
    source.withdraw(amount)
    target.deposit(amount)
'''
COPY_PROMPTS = (
    f"Rewrite this Python file with the class Account renamed to Wallet. Output the whole "
    f"file and nothing else.\n\n{CODE_FILE}",
    f"Rewrite this Python file so that every error message ends with a full stop. Output the "
    f"whole file and nothing else.\n\n{CODE_FILE}",
    f"Rewrite this Python file with the parameter amount renamed to value everywhere. Output "
    f"the whole file and nothing else.\n\n{CODE_FILE}",
)
PROMPT_SETS = {"short": SHORT_PROMPTS, "long": LONG_PROMPTS,
               "mixed": SHORT_PROMPTS + LONG_PROMPTS, "copy": COPY_PROMPTS}
