package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// load sends POST /v1/kubeconfigs from conc workers until n requests were
// sent or stop is closed, and counts the outcomes.
type load struct {
	mu       sync.Mutex
	statuses map[int]int
	errs     []error
	leases   []string
	bad      []string // answers that broke a promise (5xx without problem+json, …)
}

func runLoad(t *testing.T, e *brokerEnv, client *http.Client, conc, n int, stop <-chan struct{}) *load {
	t.Helper()
	l := &load{statuses: map[int]int{}}
	l.run(e, client, conc, n, stop)
	return l
}

// startLoad runs a load until stop is closed; done delivers it then. The
// test watches its progress with waitFor instead of sleeping.
// startLoadBroker is startBroker with the per-peer limits lifted (a million
// a minute, a million live leases): the load tests measure the broker
// under load, which the limits would cut to 30 + 60 a minute
// (limits_test.go tests those).
func startLoadBroker(t *testing.T, c *testcluster.Cluster, extra ...string) *brokerEnv {
	t.Helper()
	e := newBrokerEnv(t, c, extra...)
	pol, err := os.ReadFile(e.policy)
	require.NoError(t, err)
	writeFile(t, e.policy, string(pol)+"limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 1000000, leaseReadsPerMinute: 1000000, leaseReadsInFlight: 1000000}\n")
	e.launch(t)
	return e
}

func startLoad(e *brokerEnv, client *http.Client, conc int, stop <-chan struct{}) (l *load, done <-chan *load) {
	l = &load{statuses: map[int]int{}}
	ch := make(chan *load, 1)
	go func() {
		l.run(e, client, conc, 0, stop)
		ch <- l
	}()
	return l, ch
}

// count is how many answers with status the load has had so far.
func (l *load) count(status int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.statuses[status]
}

// waitFor waits until the load has had more than n answers with status.
func (l *load) waitFor(t *testing.T, status, n int, why string) {
	t.Helper()
	require.Eventually(t, func() bool { return l.count(status) > n }, time.Minute, 20*time.Millisecond, why)
}

func (l *load) run(e *brokerEnv, client *http.Client, conc, n int, stop <-chan struct{}) {
	var next atomic.Int64
	var wg sync.WaitGroup
	body := []byte(`{"namespace":"argo","serviceAccount":"runner","ttl":"10m"}`)
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				if n > 0 && next.Add(1) > int64(n) {
					return
				}
				select {
				case <-stop:
					return
				default:
				}
				l.one(client, "https://"+e.api+"/v1/kubeconfigs", body)
			}
		}()
	}
	wg.Wait()
}

func (l *load) one(client *http.Client, url string, body []byte) {
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	resp, err := client.Do(req)
	if err != nil {
		l.mu.Lock()
		l.errs = append(l.errs, err)
		l.mu.Unlock()
		return
	}
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.statuses[resp.StatusCode]++
	switch {
	case err != nil:
		l.bad = append(l.bad, fmt.Sprintf("%d with a broken body: %v", resp.StatusCode, err))
	case resp.StatusCode == http.StatusCreated:
		var kr apiv1.KubeconfigResponse
		if json.Unmarshal(raw, &kr) != nil || kr.LeaseID == "" || kr.Token == "" {
			l.bad = append(l.bad, "201 without a complete answer")
			return
		}
		l.leases = append(l.leases, kr.LeaseID)
	case resp.StatusCode == http.StatusServiceUnavailable:
		var p apiv1.Problem
		if resp.Header.Get("Retry-After") == "" || resp.Header.Get("Content-Type") != apiv1.MediaTypeProblem || json.Unmarshal(raw, &p) != nil {
			l.bad = append(l.bad, "503 without Retry-After and problem+json")
		}
	}
}

// keptAlive is an mTLS client that keeps up to 64 connections open.
func (e *brokerEnv) keptAlive(t *testing.T) *http.Client {
	t.Helper()
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		TLSClientConfig: e.tlsConfig(t, "west"), MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64,
	}}
}

var goroutinesRE = regexp.MustCompile(`goroutine profile: total (\d+)`)

// goroutines reads the broker's goroutine count from its pprof endpoint.
func (e *brokerEnv) goroutines(t *testing.T) int {
	t.Helper()
	out := run(t, "curl", "-sSf", "http://"+e.ops+"/debug/pprof/goroutine?debug=1")
	m := goroutinesRE.FindStringSubmatch(out)
	require.NotNil(t, m, out)
	n, _ := strconv.Atoi(m[1])
	return n
}

// rssMB is a process's resident set size in MiB.
func rssMB(t *testing.T, pid int) float64 {
	t.Helper()
	return procStatusMiB(t, pid, "VmRSS")
}

// collectLater runs the lease GC as it will run once every lease of this
// test has expired, against the same API server and policy, and returns
// how many leases it deleted.
func collectLater(t *testing.T, c *testcluster.Cluster, e *brokerEnv) int {
	t.Helper()
	p, err := policy.LoadFile(e.policy)
	require.NoError(t, err)
	later, err := broker.New(broker.Config{
		Secrets: c.Client.CoreV1(),
		Policy:  policy.NewStore(p),
		Logger:  zap.NewNop(),
		Clock:   clocktesting.NewFakeClock(time.Now().Add(11 * time.Minute)),
	})
	require.NoError(t, err)
	before := countLeases(t, c)
	_, err = later.CollectGarbage(context.Background())
	require.NoError(t, err)
	// The leases it deleted: its count also holds the unclaimed pooled
	// Secrets past their deadline (broker/pool.go), which are no lease.
	return before - countLeases(t, c)
}

// stableLeaseCount is countLeases once two counts a second apart agree.
// leaseNames are the lease Secrets' names (pooled ones left out, as
// countLeases does), with the time each was created.
func leaseNames(t *testing.T, c *testcluster.Cluster) map[string]time.Time {
	t.Helper()
	l, err := c.Client.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelManagedBy + "=" + objects.ManagedByValue + "," + objects.LabelKind + "!=" + objects.PoolKind,
	})
	require.NoError(t, err)
	out := make(map[string]time.Time, len(l.Items))
	for _, s := range l.Items {
		out[s.Name] = s.CreationTimestamp.Time
	}
	return out
}

func stableLeaseCount(t *testing.T, c *testcluster.Cluster) int {
	t.Helper()
	last := countLeases(t, c)
	require.Eventually(t, func() bool {
		n := countLeases(t, c)
		same := n == last
		last = n
		return same
	}, 30*time.Second, time.Second, "the lease count settles")
	return last
}

// TestTenThousandIssuances is the load and soak run: 10 000 issuances at
// concurrency 32 with no error, no goroutine or connection leak, and no
// lease Secret left once they are revoked or expired.
func TestTenThousandIssuances(t *testing.T) {
	if testing.Short() {
		t.Skip("load test")
	}
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startLoadBroker(t, c, "--pprof", "--log-level", "warn")
	client := e.keptAlive(t)
	runLoad(t, e, client, 32, 200, nil) // warm up connections and caches
	client.CloseIdleConnections()
	time.Sleep(500 * time.Millisecond)
	goroutinesBefore, rssBefore := e.goroutines(t), rssMB(t, e.proc.cmd.Process.Pid)

	start := time.Now()
	l := runLoad(t, e, client, 32, 10000, nil)
	elapsed := time.Since(start)
	rssAfter := rssMB(t, e.proc.cmd.Process.Pid)
	require.Empty(t, l.errs)
	require.Empty(t, l.bad)
	require.Equal(t, map[int]int{201: 10000}, l.statuses)
	t.Logf("10000 issuances at concurrency 32 in %s (%.0f/s); broker RSS %.1f MB before, %.1f MB after",
		elapsed.Round(time.Millisecond), 10000/elapsed.Seconds(), rssBefore, rssAfter)

	client.CloseIdleConnections()
	require.Eventually(t, func() bool { return e.goroutines(t) <= goroutinesBefore+5 }, 10*time.Second, 200*time.Millisecond,
		"goroutines must return to their level before the run (%d)", goroutinesBefore)

	// Revoke a thousand through the API, let the GC take the rest.
	revoked := &load{statuses: map[int]int{}}
	var wg sync.WaitGroup
	ids := make(chan string)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range ids {
				req, _ := http.NewRequest(http.MethodDelete, "https://"+e.api+"/v1/leases/"+id, nil)
				resp, err := client.Do(req)
				revoked.mu.Lock()
				if err != nil {
					revoked.errs = append(revoked.errs, err)
				} else {
					revoked.statuses[resp.StatusCode]++
					resp.Body.Close()
				}
				revoked.mu.Unlock()
			}
		}()
	}
	for _, id := range l.leases[:1000] {
		ids <- id
	}
	close(ids)
	wg.Wait()
	require.Empty(t, revoked.errs)
	require.Equal(t, map[int]int{204: 1000}, revoked.statuses)
	require.Equal(t, 10200-1000, countLeases(t, c))
	require.Equal(t, 9200, collectLater(t, c, e))
	require.Zero(t, countLeases(t, c), "no lease Secret is left")
}

// TestAPIServerOutageUnderLoad stops the API server in the middle of a load
// run: requests get 503 with Retry-After, nothing panics, no partial lease
// is left once it is back, and the broker recovers without a restart.
func TestAPIServerOutageUnderLoad(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startLoadBroker(t, c)
	client := e.keptAlive(t)
	stop := make(chan struct{})
	running, done := startLoad(e, client, 8, stop)

	running.waitFor(t, http.StatusCreated, 20, "issuances before the outage")
	require.NoError(t, c.StopAPIServer())
	running.waitFor(t, http.StatusServiceUnavailable, 20, "503s during the outage")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, c.StartAPIServer(ctx))
	require.Eventually(t, func() bool {
		status, _, err := e.curl(t, "", "http://"+e.ops+"/readyz")
		return err == nil && status == 200
	}, 30*time.Second, 100*time.Millisecond, "ready again without a restart")
	running.waitFor(t, http.StatusCreated, running.count(http.StatusCreated)+20, "issuances after the outage")
	close(stop)
	l := <-done

	t.Logf("outcomes: %v, transport errors: %d", l.statuses, len(l.errs))
	require.Empty(t, l.bad)
	require.Empty(t, l.errs, "the broker answers even while the API server is down")
	require.Greater(t, l.statuses[503], 0, "the outage was seen")
	require.Greater(t, l.statuses[201], 0)
	for status := range l.statuses {
		require.Contains(t, []int{201, 503}, status)
	}
	require.NotContains(t, e.proc.logs.String(), "panic")
	// Leases of requests that failed half-way are deleted once the API
	// server is back (the broker retries in the background).
	require.Eventually(t, func() bool { return countLeases(t, c) == len(l.leases) }, 30*time.Second, 200*time.Millisecond,
		"only the leases of answered requests remain")
}

// TestBrokerKilledMidRun kills the broker with SIGKILL under load and starts
// it again: it serves at once, lists what the dead process left, and the
// lease GC removes the leftovers.
func TestBrokerKilledMidRun(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startLoadBroker(t, c)
	client := e.keptAlive(t)
	stop := make(chan struct{})
	running, done := startLoad(e, client, 16, stop)
	running.waitFor(t, http.StatusCreated, 20, "the load is under way")
	require.NoError(t, e.proc.cmd.Process.Signal(syscall.SIGKILL))
	err := <-e.proc.done
	e.proc.done <- err
	close(stop)
	l := <-done

	// A create the dead broker sent may still be finishing in the API
	// server: count once the count holds still.
	left := stableLeaseCount(t, c)
	t.Logf("answered %d, transport errors %d, lease Secrets left %d", len(l.leases), len(l.errs), left)
	require.GreaterOrEqual(t, left, len(l.leases))
	require.LessOrEqual(t, left-len(l.leases), 16, "at most one unanswered lease per in-flight request")

	before := leaseNames(t, c)
	e.launch(t)
	status, body := e.postKubeconfig(t, clientPrefix(e, "west"), `{"namespace":"argo","serviceAccount":"runner","ttl":"10m"}`)
	require.Equal(t, 201, status, body)
	var issued apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &issued))
	// Nothing but the new lease was added or removed by the new broker.
	// A write the dead one sent can still land late under load (a claim
	// of one of its pooled Secrets turns it into a lease): such a lease
	// is the dead broker's, so it predates the new one.
	after := leaseNames(t, c)
	require.Contains(t, after, "tokenbroker-lease-"+issued.LeaseID)
	for name := range before {
		require.Contains(t, after, name, "nothing the killed broker left was removed")
	}
	for name, created := range after {
		if _, old := before[name]; !old && name != "tokenbroker-lease-"+issued.LeaseID {
			require.False(t, created.After(after["tokenbroker-lease-"+issued.LeaseID]), "%s is no lease of the new broker's (creation times are in whole seconds)", name)
			t.Logf("a late write of the killed broker: %s", name)
		}
	}
	status, body, err = e.curl(t, clientPrefix(e, "west"), "https://"+e.api+"/v1/leases")
	require.NoError(t, err)
	require.Equal(t, 200, status)
	var list apiv1.LeaseList
	require.NoError(t, json.Unmarshal([]byte(body), &list))
	require.Len(t, list.Items, len(after), "the peer sees what the killed broker left, and can revoke it")

	require.Equal(t, len(after), collectLater(t, c, e))
	require.Zero(t, countLeases(t, c))
}

// TestTwoReplicas runs two brokers on one API server: a lease issued by one
// is listed and revoked through the other.
func TestTwoReplicas(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	a := startBroker(t, c)
	b := a.replica(t)
	west := clientPrefix(a, "west")

	status, body := a.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner"}`)
	require.Equal(t, 201, status, body)
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &resp))

	status, body, err := b.curl(t, west, "https://"+b.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 200, status, body)
	status, _, err = b.curl(t, west, "-X", "DELETE", "https://"+b.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 204, status)
	status, _, err = a.curl(t, west, "https://"+a.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 404, status)
	require.Eventually(t, func() bool { return !tokenValid(t, c, resp.Token) }, 20*time.Second, 100*time.Millisecond)
}

// TestGracefulShutdown sends SIGTERM under load: requests in flight are
// answered, nothing gets a 5xx, the process exits 0 and every lease in the
// API belongs to an answered request.
func TestGracefulShutdown(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startLoadBroker(t, c)
	client := e.keptAlive(t)
	stop := make(chan struct{})
	running, done := startLoad(e, client, 16, stop)
	running.waitFor(t, http.StatusCreated, 20, "the load is under way")
	require.NoError(t, e.proc.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-e.proc.done:
		require.NoError(t, err, "exit status after SIGTERM")
		e.proc.done <- err
	case <-time.After(30 * time.Second):
		t.Fatal("no exit within 30s of SIGTERM")
	}
	close(stop)
	l := <-done
	t.Logf("outcomes: %v, connection errors after shutdown: %d", l.statuses, len(l.errs))
	require.Empty(t, l.bad)
	for status := range l.statuses {
		require.Equal(t, 201, status, "every answered request succeeded")
	}
	require.Equal(t, len(l.leases), countLeases(t, c), "no lease without an answer")
}

// clientPrefix is the path of a client's certificate and key, less the
// .crt and .key extensions.
func clientPrefix(e *brokerEnv, name string) string { return e.dir + "/" + name }

// tokenValid asks the API server whether token still authenticates.
func tokenValid(t *testing.T, c *testcluster.Cluster, token string) bool {
	t.Helper()
	r, err := c.Client.AuthenticationV1().TokenReviews().Create(context.Background(),
		&authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return r.Status.Authenticated
}
