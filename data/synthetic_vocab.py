"""Word lists of the synthetic biography corpus.

Names and most attribute values are combinatorial (first x last names, city
prefix x suffix, company word x word) so there are tens of thousands of unique
people and hundreds to thousands of values per attribute: remembering a fact
costs real capacity, which is the point of memory-vs-dense experiments.
All names are invented; any match with a real person is a coincidence.
"""

from __future__ import annotations

FIRST_NAMES = """
Aaron Abigail Ada Adrian Agnes Aiden Alba Alden Alicia Alma Amara Ambrose Anika Ansel Arden Aria Arlo
Astrid Aurelio Avery Basil Beatrix Bennett Bianca Blaise Bodhi Brielle Bronwen Caius Calla Camden Carys
Cassius Celeste Cillian Clara Cormac Cosima Dagny Dalia Damon Daphne Darius Delphine Dorian Edda Edric
Elio Elodie Emeric Enzo Esme Ezra Fabian Farah Felix Fenna Finnian Flora Gideon Greta Griffin Hallie
Hamish Hazel Idris Ilse Imogen Ines Isidore Ivo Jasper Joaquin Jorah Juno Kael Kaia Keir Kiran Lachlan
Lark Leander Leona Linnea Lorcan Lucian Lyra Magnus Malin Marek Marisol Maren Milo Mireille Nadia Nico
Noor Oona Orin Otto Paloma Percival Petra Quentin Quilla Rafferty Rhea Rocco Romilly Ronan Rosalind
Rufus Sabine Saoirse Selim Seraphina Silas Solveig Soren Tamsin Tarquin Teodor Thea Tobias Ulla Ulric
Valentina Vesna Viggo Willa Wolfgang Xanthe Yara Yusuf Zelda Zephyr Zora Anselm Berit Casimir Dove
Eamon Freya Gunnar Honora Ivar Jolene Kasimir Liesel Mathis Nerys Osric Priya Rowena Sander
""".split()

LAST_NAMES = """
Abernathy Achterberg Aldridge Alvarado Amsel Ashdown Babington Balfour Barlowe Beaumont Bellweather
Benedetti Birchall Blackwood Bramwell Brightwater Brocklehurst Calloway Carrow Castellan Chadwick
Cheswick Cloudsley Corrigan Crestwood Dagenais Dalgleish Davenhall Delacroix Dunmore Eastwick Ellsworth
Embry Esterhazy Fairbanks Falkner Farrington Fenwick Fitzalan Foxcroft Galloway Garrick Gildersleeve
Glanville Goodacre Greyhaven Gunderson Hadleigh Halloran Hargreave Hartigan Hawthorne Heathcote
Holloway Huxtable Ingleby Iredale Jessop Kavanagh Kettleby Kingsley Kirkwood Lachance Langley Larkspur
Lathrop Leverett Lindqvist Lockhart Loxley Lyndhurst Macalister Malloy Marchbanks Marlowe Mayhew
Merriweather Montrose Moorcroft Mortimer Nettleship Northcott Oakes Ogilvy Okonkwo Oldcastle Ormsby
Pemberton Pendergast Penhaligon Pettigrew Quartermaine Quimby Radcliffe Ravenscroft Redgrave Rookwood
Rosenthal Rutherford Saltonstall Sandoval Scarborough Selwyn Sheffield Silverman Sinclair Stanhope
Stirling Strathmore Sutherland Tallis Tenbrook Thackeray Thornbury Trevelyan Tremaine Underhill
Vandermeer Vasquez Villiers Wadsworth Wakefield Warrington Weatherby Whitcombe Wilberforce Winterbourne
Wolstenholme Woodhouse Wrenfield Yardley Yelverton Zabriskie Zimmerli Ackroyd Blythe Cadwallader
Dunstable Eberhardt Featherstone Gainsborough Harrowgate Isherwood Jardine Kilbride Lowther Mapplethorpe
Nightingale Osgood Prendergast Quarrington Rainsford Stokesay Tolliver Upjohn Vickery Whitlock Yarborough
Ashcombe Bellamy Cogswell Drummond Ebbsworth Fortescue Gresham Hollingsworth Ironside Jellicoe Kempthorne
Lisle Mowbray Neville Ollerenshaw Peverell Ramsbottom Sackville Tregarthen Urquhart Verity Wetherall
""".split()

CITY_PREFIXES = """
Ash Bright Cedar Dun Elm Fair Glen Hollow Iron Kings Lake Maple North Oak Pine Queens Raven Silver Stone
Thorn Upper Vale West Wolf Amber Bell Clear Deer East Frost Gold High Long Mill Red Salt South Summer
Winter Hazel
""".split()

CITY_SUFFIXES = """
ford bridge haven field port wood ton burg mouth ville dale stead bury wick moor crest gate holm ridge
shore brook minster by cliff fell
""".split()

COMPANY_FIRST = """
Apex Bluefin Cobalt Driftwood Ember Falcon Granite Harbor Indigo Juniper Keystone Lumen Meridian Nimbus
Orchid Pinnacle Quartz Redwood Sapphire Tidewater Umber Vertex Willow Zenith Aurora Beacon Cascade
Delta Evergreen Fjord Glacier Horizon Ivory Jade Kestrel Lighthouse Monarch Nova Obsidian Polaris
""".split()

COMPANY_SECOND = """
Dynamics Analytics Systems Labs Industries Holdings Partners Logistics Robotics Foods Textiles Energy
Media Pharmaceuticals Software Motors Insurance Consulting Shipping Biotech Aerospace Publishing Foundry
Networks Bank
""".split()

UNIVERSITY_PATTERNS = ("University of {}", "{} Institute of Technology", "{} State College")

OCCUPATIONS = [
    "accountant", "actuary", "architect", "archivist", "astronomer", "audiologist", "baker", "barista",
    "biologist", "bookbinder", "botanist", "brewer", "carpenter", "cartographer", "chemist", "chef",
    "civil engineer", "clockmaker", "composer", "court reporter", "dentist", "dietitian", "economist",
    "editor", "electrician", "epidemiologist", "event planner", "fashion designer", "firefighter",
    "florist", "game designer", "geologist", "glassblower", "graphic designer", "historian",
    "hydrologist", "illustrator", "interior designer", "interpreter", "jeweler", "journalist",
    "landscape architect", "lawyer", "librarian", "locksmith", "marine biologist", "mathematician",
    "mechanic", "meteorologist", "midwife", "museum curator", "music teacher", "nurse", "oceanographer",
    "optometrist", "orthodontist", "paramedic", "pharmacist", "photographer", "physicist",
    "physiotherapist", "piano tuner", "pilot", "plumber", "potter", "radio host", "sculptor",
    "software developer", "sommelier", "speech therapist", "statistician", "surveyor", "tailor",
    "tax advisor", "translator", "urban planner", "veterinarian", "violin maker", "web designer",
    "wildlife ranger", "zoologist",
]

MAJORS = [
    "anthropology", "applied mathematics", "archaeology", "art history", "astrophysics", "biochemistry",
    "bioengineering", "chemical engineering", "classics", "cognitive science", "comparative literature",
    "computer science", "criminology", "dance", "ecology", "economics", "electrical engineering",
    "environmental science", "film studies", "finance", "forestry", "genetics", "geography", "geophysics",
    "graphic design", "history", "industrial design", "international relations", "journalism",
    "linguistics", "marine science", "materials science", "mechanical engineering", "medieval studies",
    "microbiology", "music theory", "neuroscience", "nutrition", "oceanography", "philosophy",
    "political science", "psychology", "public health", "robotics", "sociology", "statistics",
    "theater", "urban studies", "veterinary science", "zoology",
]

FOODS = [
    "apple strudel", "baklava", "banana bread", "beef stew", "bibimbap", "blueberry pancakes", "borscht",
    "bouillabaisse", "butter chicken", "carrot cake", "cheese fondue", "chicken curry", "chili con carne",
    "chocolate mousse", "clam chowder", "coq au vin", "crab cakes", "creme brulee", "dumplings",
    "eggs benedict", "empanadas", "falafel", "fish and chips", "french onion soup", "fried rice",
    "gazpacho", "gnocchi", "goulash", "grilled salmon", "gumbo", "hummus", "jambalaya", "key lime pie",
    "lamb kebabs", "lasagna", "lemon tart", "lentil soup", "lobster bisque", "mac and cheese",
    "mango sticky rice", "meatballs", "minestrone", "miso soup", "moussaka", "mushroom risotto",
    "nachos", "pad thai", "paella", "pancakes", "peach cobbler", "pecan pie", "pho", "pierogi",
    "pizza margherita", "pork dumplings", "pot roast", "pumpkin pie", "quiche", "ramen", "ratatouille",
    "roast duck", "samosas", "shepherd's pie", "shrimp tacos", "spaghetti carbonara", "spring rolls",
    "steak frites", "sushi", "tabbouleh", "tamales", "tiramisu", "tomato soup", "tortellini",
    "vegetable curry", "waffles", "wiener schnitzel", "yakitori", "zucchini bread",
]

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
DAYS_IN_MONTH = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
BIRTH_YEARS = range(1940, 2005)


def cities() -> list[str]:
    return [p + s for p in CITY_PREFIXES for s in CITY_SUFFIXES]


def companies() -> list[str]:
    return [f"{a} {b}" for a in COMPANY_FIRST for b in COMPANY_SECOND]


def universities() -> list[str]:
    return [pattern.format(city) for city in cities() for pattern in UNIVERSITY_PATTERNS]
