package integration

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// pagedPolicy grants west two namespaces and south one, with the per-peer
// limits lifted: the test issues more leases than a page.
const pagedPolicy = `limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 1000000, leaseReadsPerMinute: 1000000, leaseReadsInFlight: 1000000}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - {namespaces: [pages-a, pages-b], serviceAccounts: [runner]}
  - name: south
    identity: spiffe://it.tokenbroker.test/cluster/south
    grants:
      - {namespaces: [pages-a], serviceAccounts: [runner]}
`

// TestLeasePagesWalkEveryLeaseOnce issues more leases than the default
// page, in two namespaces, and walks GET /v1/leases page by page: the API
// server does the paging, and nothing is lost or repeated.
func TestLeasePagesWalkEveryLeaseOnce(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	for _, ns := range []string{"pages-a", "pages-b"} {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	s := startStack(t, c, pagedPolicy, withMaxLiveLeases(1000000))
	west, south := s.client(t, "west"), s.client(t, "south")

	// 700 in pages-a and 400 in pages-b for west; 50 of south's among
	// them in pages-a, which west must not see.
	want := map[string]bool{}
	var mu sync.Mutex
	issueMany := func(cl *http.Client, ns string, n int, record bool) {
		var wg sync.WaitGroup
		work := make(chan struct{})
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range work {
					var resp apiv1.KubeconfigResponse
					status, body, err := tryDo(cl, http.MethodPost, s.url+"/v1/kubeconfigs", "", apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "runner"}, &resp)
					if err != nil || status != http.StatusCreated {
						t.Errorf("issue in %s: %d %s %v", ns, status, body, err)
						continue
					}
					if record {
						mu.Lock()
						want[resp.LeaseID] = true
						mu.Unlock()
					}
				}
			}()
		}
		for i := 0; i < n; i++ {
			work <- struct{}{}
		}
		close(work)
		wg.Wait()
	}
	issueMany(west, "pages-a", 700, true)
	issueMany(south, "pages-a", 50, false)
	issueMany(west, "pages-b", 400, true)
	require.Len(t, want, 1100)

	walk := func(t *testing.T, limit int) (pages []apiv1.LeaseList) {
		token := ""
		for {
			q := url.Values{}
			if limit > 0 {
				q.Set("limit", strconv.Itoa(limit))
			}
			if token != "" {
				q.Set("continue", token)
			}
			var page apiv1.LeaseList
			status, body := do(t, west, http.MethodGet, s.url+"/v1/leases?"+q.Encode(), nil, &page)
			require.Equal(t, http.StatusOK, status, string(body))
			pages = append(pages, page)
			if page.Continue == "" {
				return pages
			}
			require.NotEqual(t, token, page.Continue)
			token = page.Continue
			require.Less(t, len(pages), 100, "the walk ends")
		}
	}
	requireEveryLeaseOnce := func(t *testing.T, pages []apiv1.LeaseList, limit int) {
		seen := map[string]bool{}
		for _, p := range pages {
			require.LessOrEqual(t, len(p.Items), limit)
			for _, l := range p.Items {
				require.False(t, seen[l.ID], "lease %s listed twice", l.ID)
				seen[l.ID] = true
				require.Equal(t, "west", l.Peer)
			}
		}
		require.Equal(t, want, seen, "every lease of west, and only those")
	}

	t.Run("The default page is 500 and the walk gets every lease once.", func(t *testing.T) {
		pages := walk(t, 0)
		require.Len(t, pages[0].Items, lease.DefaultLeasePageSize, "a caller that ignores continue gets the first 500")
		requireEveryLeaseOnce(t, pages, lease.DefaultLeasePageSize)
	})

	t.Run("A page size that does not divide the namespaces' leases crosses from one namespace to the next.", func(t *testing.T) {
		pages := walk(t, 333)
		requireEveryLeaseOnce(t, pages, 333)
		crossed := false
		for _, p := range pages {
			if len(p.Items) > 1 && p.Items[0].Namespace != p.Items[len(p.Items)-1].Namespace {
				crossed = true
			}
		}
		require.True(t, crossed, "one page holds the end of pages-a and the start of pages-b")
	})

	t.Run("The largest page is 1000; more is 400.", func(t *testing.T) {
		pages := walk(t, lease.MaxLeasePageSize)
		requireEveryLeaseOnce(t, pages, lease.MaxLeasePageSize)
		status, body := do(t, west, http.MethodGet, s.url+"/v1/leases?limit=1001", nil, nil)
		require.Equal(t, http.StatusBadRequest, status, string(body))
	})

	t.Run("A forged API server token inside a well-formed continue token is 400, not 500.", func(t *testing.T) {
		// Our format around an API server token that climbs out of the
		// list's key prefix.
		api := base64.StdEncoding.EncodeToString([]byte(`{"v":"meta.k8s.io/v1","rv":1,"start":"../x"}`))
		forged := base64.RawURLEncoding.EncodeToString([]byte("l1\npages-a\n" + api))
		status, body := do(t, west, http.MethodGet, s.url+"/v1/leases?continue="+forged, nil, nil)
		require.Equal(t, http.StatusBadRequest, status, string(body))
		require.Contains(t, string(body), `"field":"continue"`)
	})
}
