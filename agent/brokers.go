package agent

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// brokers holds one API client per broker URL. Every client presents the
// identity in service (through the holder, at each handshake) and trusts
// its bundle; when a renewal brings a new bundle (a CA rotation), the
// clients are made again with it.
type brokers struct {
	holder *identityHolder
	// trust, if set, is the CAs that verify brokers in place of the
	// identity's bundle (identity.trustBundleFrom).
	trust func() *trustState

	mu      sync.Mutex
	bundle  []byte
	clients map[string]*client.Client
}

func newBrokers(h *identityHolder) *brokers {
	return &brokers{holder: h, clients: map[string]*client.Client{}}
}

var errNoIdentityYet = errors.New("the agent has no client certificate yet")

// brokerIdleConnTimeout closes a broker connection soon after its last
// request. A target talks to its broker once per refresh, minutes or hours
// apart (and once more revokeGrace later), so a connection kept for the
// client's default 90 s serves nothing and holds two goroutines and its
// TLS and buffer state, on the agent and on the broker, per broker URL
// (with 100 targets, about 3 MB of the agent's RSS; docs/agent.md,
// "Measured"). A refresh's own requests, and retries a second apart, still
// share one.
const brokerIdleConnTimeout = 5 * time.Second

func (b *brokers) client(url string) (*client.Client, error) { return b.clientAs(url, "") }

// clientAs is client for a target that sends the workload token in
// tokenFile ("" for none); each (broker, token file) pair has its client.
func (b *brokers) clientAs(url, tokenFile string) (*client.Client, error) {
	id := b.holder.get()
	if id == nil {
		return nil, errNoIdentityYet
	}
	roots, bundle := id.roots, id.bundlePEM
	var verify func(tls.ConnectionState) error
	if b.trust != nil {
		st := b.trust()
		if st == nil {
			return nil, errNoTrustYet
		}
		if st.err != nil {
			// Fail closed: no client, and no kept-alive connection to a
			// broker verified with CAs no longer in service.
			b.mu.Lock()
			defer b.mu.Unlock()
			for _, c := range b.clients {
				c.CloseIdleConnections()
			}
			b.clients, b.bundle = map[string]*client.Client{}, nil
			return nil, st.err
		}
		roots, bundle, verify = st.pool, st.pem, st.verify
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !bytes.Equal(bundle, b.bundle) {
		for _, c := range b.clients {
			c.CloseIdleConnections()
		}
		b.clients = map[string]*client.Client{}
		b.bundle = bundle
	}
	key := url + "\x00" + tokenFile
	if c, ok := b.clients[key]; ok {
		return c, nil
	}
	cfg := client.Config{URL: url, RootCAs: roots, GetClientCertificate: b.holder.GetClientCertificate,
		IdleConnTimeout: brokerIdleConnTimeout, VerifyConnection: verify}
	if tokenFile != "" {
		cfg.WorkloadToken = client.WorkloadTokenFile(tokenFile)
	}
	c, err := client.New(cfg)
	if err != nil {
		return nil, err
	}
	b.clients[key] = c
	return c, nil
}

// closeIdle closes kept-alive connections, so that the next requests
// handshake again and present a renewed certificate.
func (b *brokers) closeIdle() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range b.clients {
		c.CloseIdleConnections()
	}
}

// brokerRef is one broker, reached through the client in force at each
// call.
type brokerRef struct {
	b   *brokers
	url string
	// workloadTokenFile, if set, is sent as the workload token.
	workloadTokenFile string
}

var (
	_ brokerAPI = brokerRef{}
	_ renewAPI  = brokerRef{}
	_ jwksAPI   = brokerRef{}
)

func (r brokerRef) PutJWKS(ctx context.Context, doc []byte) (*apiv1.PeerJWKS, error) {
	c, err := r.b.client(r.url)
	if err != nil {
		return nil, err
	}
	return c.PutJWKS(ctx, doc)
}

func (r brokerRef) PutPods(ctx context.Context, uids []string) (*apiv1.PeerLivePods, error) {
	c, err := r.b.client(r.url)
	if err != nil {
		return nil, err
	}
	return c.PutPods(ctx, uids)
}

func (r brokerRef) Kubeconfig(ctx context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	c, err := r.b.clientAs(r.url, r.workloadTokenFile)
	if err != nil {
		return nil, err
	}
	return c.Kubeconfig(ctx, req)
}

func (r brokerRef) WhoAmI(ctx context.Context) (*apiv1.WhoAmI, error) {
	c, err := r.b.clientAs(r.url, r.workloadTokenFile)
	if err != nil {
		return nil, err
	}
	return c.WhoAmI(ctx)
}

func (r brokerRef) RevokeLease(ctx context.Context, id string) error {
	c, err := r.b.clientAs(r.url, r.workloadTokenFile)
	if err != nil {
		return err
	}
	return c.RevokeLease(ctx, id)
}

func (r brokerRef) Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	c, err := r.b.client(r.url)
	if err != nil {
		return nil, err
	}
	return c.Renew(ctx, req)
}

// NewIdentityClient returns a client of the broker at brokerURL that
// presents the identity in dir and trusts dir's bundle, as the agent's own
// clients do ("tokenbroker get kubeconfig" uses it). dir is read once; an
// interrupted replacement of its files is finished first. The identity is
// a cluster's, or a workload's pod certificate (the kubelet's
// podCertificate volume, certificateChainPath tls.crt and keyPath tls.key,
// beside a ca.crt).
func NewIdentityClient(ctx context.Context, brokerURL string, dir IdentityDir) (*client.Client, error) {
	return NewWorkloadClient(ctx, brokerURL, dir, "")
}

// NewWorkloadClient is NewIdentityClient for a workload that proves itself
// with the ServiceAccount token in workloadTokenFile ("" for none), read
// at every request.
func NewWorkloadClient(ctx context.Context, brokerURL string, dir IdentityDir, workloadTokenFile string) (*client.Client, error) {
	id, err := dirStore{dir: dir, workload: true}.load(ctx)
	if err != nil {
		return nil, err
	}
	if leaf := id.leaf(); !time.Now().Before(leaf.NotAfter) {
		return nil, fmt.Errorf("the client certificate in %s expired at %s; renew it or enroll again", dir, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	h := &identityHolder{}
	h.set(id)
	cfg := client.Config{URL: brokerURL, RootCAs: id.roots, GetClientCertificate: h.GetClientCertificate}
	if workloadTokenFile != "" {
		cfg.WorkloadToken = client.WorkloadTokenFile(workloadTokenFile)
	}
	return client.New(cfg)
}
