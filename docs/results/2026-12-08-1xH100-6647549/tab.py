import sys,statistics,collections
def read(path):
    d=collections.defaultdict(lambda: collections.defaultdict(list)); alg={}
    v=None
    for line in open(path):
        if line.startswith('=='): v=line.split()[1]; continue
        f=line.split()
        if len(f)>=6 and f[0].isdigit() and f[1].isdigit():
            d[int(f[0])][v].append(float(f[5]))
            if len(f)>9: alg[(v,int(f[0]))]=f[9]
    return d,alg
path=sys.argv[1]; ref=sys.argv[2] if len(sys.argv)>2 else 'vader'
d,alg=read(path)
vs=[]
for b in d:
    for v in d[b]:
        if v not in vs: vs.append(v)
print(path, ' '.join(f"{v:>16}" for v in vs))
for b in sorted(d):
    m={k:statistics.median(x) for k,x in d[b].items()}
    cells=[]
    for v in vs:
        t=m.get(v)
        if t is None: cells.append(f"{'-':>16}"); continue
        r=m.get(ref,0)/t if ref in m else 0
        cells.append(f"{t:9.2f} ({r:4.2f})")
    print(f"{b:>9} "+' '.join(cells)+"  "+' '.join(alg.get((v,b),'') for v in vs if (v,b) in alg)[:60])
