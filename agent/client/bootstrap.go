package client

import (
	"context"
	"fmt"
	"net/http"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// FetchTrustBundle fetches GET /v1/trust-bundle from a broker the client
// does not trust yet. It fails unless the bundle holds the CA with the
// pinned fingerprint ("sha256:<hex>", as `tokenbroker pki join-token`
// prints it) and the broker's certificate chains to that CA alone; it
// returns the pinned CA and the bundle's CAs that chain to it, not the
// bundle as served (see pki.Bootstrap.Verify). This is how a new cluster
// gets its first trust anchor without turning verification off.
func FetchTrustBundle(ctx context.Context, brokerURL, fingerprint string) ([]byte, error) {
	u, err := parseBrokerURL(brokerURL)
	if err != nil {
		return nil, err
	}
	if fingerprint == "" {
		return nil, fmt.Errorf("client: a CA fingerprint to pin is required")
	}
	var b pki.Bootstrap
	hc := &http.Client{Timeout: 30 * time.Second, Transport: newTransport(b.Config(), defaultIdleConnTimeout)}
	defer hc.CloseIdleConnections()
	var tb apiv1.TrustBundle
	if err := roundTrip(ctx, hc, http.MethodGet, u.String()+"/v1/trust-bundle", "", nil, http.StatusOK, &tb); err != nil {
		return nil, err
	}
	trusted, err := b.Verify([]byte(tb.CABundle), fingerprint, u.Host)
	if err != nil {
		return nil, err
	}
	return trusted, nil
}
